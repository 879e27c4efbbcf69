"""Worker process for Math-Verify checks (started by ``reward_models.math_verify_check``).

Reads one JSON request per line on stdin (``{"predicted": ..., "reference": ...}``), answers one
JSON line on stdout (``{"equal": bool}`` or ``{"error": "..."}``). Only LaTeX extraction is used:
Math-Verify's plain-expression extraction hands text to sympy's ``parse_expr`` (which calls
``eval``), so it is never enabled and no completion text is ever run as code. The parent bounds each
check with its own timeout and kills this process when one runs over; Math-Verify's signal-based
timeouts are therefore off. Standalone on purpose: it imports nothing from this project.
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
    logging.disable(logging.WARNING)  # Math-Verify warns on every call that its own timeout is off
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold = parse("\\boxed{" + request["reference"] + "}", extraction_config=config, parsing_timeout=None)
            pred = parse("\\boxed{" + request["predicted"] + "}", extraction_config=config, parsing_timeout=None)
            answer = {"equal": bool(gold and pred and verify(gold, pred, timeout_seconds=None))}
        except Exception as exc:  # a malformed answer must not end the worker
            answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
