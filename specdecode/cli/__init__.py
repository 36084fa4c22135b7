"""Command line: `specdecode generate | demo | serve | bench | data | train | calibrate | models | export`.

Contract (other tools rely on it):
  specdecode generate --target MODEL --method {ar,ngram,draft,...} [--drafter MODEL]
      [--num-draft-tokens K] [--temperature T] [--top-k K] [--top-p P] [--seed S]
      [--max-new-tokens N] [--dtype auto|bf16|fp32|int8|int4] [--chat]
      (--prompt TEXT | --prompts FILE.jsonl) [--json]
  specdecode serve --target MODEL --method M [--drafter DIR] [--host 127.0.0.1] [--port 8000]
      [--max-batch N] [--max-model-len L] [--policy scheduled|...] [--max-queue Q]
      [--limit-concurrency C] [--timeout-keep-alive S] [--timeout-header S] [--timeout-body S]
      OpenAI-compatible HTTP server (specdecode/engine/server.py) until SIGINT / SIGTERM.
With --json: one JSON object per prompt on stdout (id, text, token_ids, num_new_tokens,
num_steps, tau, accepted_per_position, decode_time_s, tokens_per_s, ...). Without it, text
streams to stdout and a summary goes to stderr. User errors print one line `error: ...` and
exit with status 2, never a traceback.

Layout: `options.py` declares the options several commands share (defaults in one place); one
module per command group builds its parsers (`add_parsers(sub)`) and holds their handlers, which
each parser names with `set_defaults(handler=...)`.
"""

from __future__ import annotations

import argparse
import sys

from specdecode.cli import bench, data, export, generate, models, serve, train
from specdecode.errors import SpecDecodeError

COMMAND_GROUPS = (generate, bench, data, train, serve, models, export)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        a.handler(a)
    except SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
