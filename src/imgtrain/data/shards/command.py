"""`imgtrain-shards SRC DST` (also `make shards`): the converter's command, which first checks that the shards
engine (LitData, boto3: `pip install -e '.[shards]'`) can be imported, so that a missing one is one line, not a
traceback. This module imports neither; `convert` (which imports both) is imported only once they are there."""

from __future__ import annotations

import importlib
import sys

from imgtrain.host.optional import MissingEngine, require_extra


def main(argv: list[str] | None = None) -> int:
    try:
        require_extra("shards", "imgtrain-shards")
    except MissingEngine as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return importlib.import_module("imgtrain.data.shards.convert").main(argv)


if __name__ == "__main__":
    sys.exit(main())
