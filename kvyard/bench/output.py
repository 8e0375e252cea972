"""How a benchmark hands over its result: JSON on stdout, and the same in a file when asked."""

import json
from pathlib import Path


def emit_json(result: dict, json_out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")
