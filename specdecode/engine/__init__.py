"""Serving: continuous-batching engine, confidence scheduler, OpenAI-compatible HTTP server.

Contract: `engine.Engine` steps a `SpeculativeDecoder` in a background thread;
`scheduler.ConfidenceScheduler` is the DSpark-style draft-length policy with its SPS profile;
`server.create_app` / `server.serve` expose the engine over HTTP; `metrics.Metrics` renders
Prometheus text. FastAPI and uvicorn are imported only by `server` (the `serve` extra).
"""
