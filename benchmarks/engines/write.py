"""Write ENGINES_SRC with one engine's own writer: python write.py litdata|mosaic|webdataset."""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import OUT, PER_SHARD, listing  # noqa: E402


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def litdata_item(item: tuple[int, str, int]) -> dict:
    index, path, label = item
    return {"index": index, "label": label, "image": read(path)}


def main(engine: str) -> None:
    items, dst = listing(), os.path.join(OUT, engine)
    shutil.rmtree(dst, ignore_errors=True)
    if engine == "litdata":
        import litdata

        litdata.optimize(
            fn=litdata_item, inputs=items, output_dir=dst, chunk_size=PER_SHARD, num_workers=1,
            reorder_files=False, keep_data_ordered=True, verbose=False,
        )  # fmt: skip
    elif engine == "mosaic":
        from streaming import MDSWriter

        columns = {"image": "bytes", "label": "int", "index": "int"}
        with MDSWriter(out=dst, columns=columns, size_limit=PER_SHARD * 2700) as writer:
            for index, path, label in items:
                writer.write({"image": read(path), "label": label, "index": index})
    elif engine == "webdataset":
        import webdataset as wds

        os.makedirs(dst)
        with wds.ShardWriter(os.path.join(dst, "train-%06d.tar"), maxcount=PER_SHARD, mtime=0, verbose=0) as writer:
            for index, path, label in items:
                writer.write({"__key__": f"{index:06d}", "jpg": read(path), "cls": label})


if __name__ == "__main__":
    main(sys.argv[1])
