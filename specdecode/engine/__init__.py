"""Serving: continuous-batching engine and the OpenAI-compatible HTTP server.

Contract: `engine.Engine` steps a `SpeculativeDecoder` in a background thread (the DSpark-style
draft-length policy it usually runs is `policy.ScheduledK`); `server.create_app` /
`server.serve` expose the engine over HTTP; `metrics.Metrics` renders Prometheus text. FastAPI
and uvicorn are imported only by `server` (the `serve` extra).
"""
