"""One measurement: images/s of one engine's loader (read, decode, crop, collate) over epochs 2-3, after a warm-up
epoch, with N DataLoader workers. python measure.py folder|litdata|mosaic|webdataset N; prints one JSON line."""

import glob
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import BATCH, OUT, listing, pipeline  # noqa: E402


def build(engine: str, workers: int):
    kw = {"batch_size": BATCH, "num_workers": workers, "persistent_workers": workers > 0, "drop_last": True}
    if engine == "folder":
        items = listing()

        class Folder(torch.utils.data.Dataset):
            def __len__(self):
                return len(items)

            def __getitem__(self, i):
                _, path, label = items[i]
                with open(path, "rb") as f:
                    return pipeline(f.read(), label)

        return torch.utils.data.DataLoader(Folder(), shuffle=True, generator=torch.Generator().manual_seed(0), **kw)
    if engine == "litdata":
        import litdata

        class Lit(litdata.StreamingDataset):
            def __getitem__(self, index):
                sample = super().__getitem__(index)
                return pipeline(bytes(sample["image"]), sample["label"])

        dataset = Lit(os.path.join(OUT, "litdata"), shuffle=True, seed=0, drop_last=True)
        return litdata.StreamingDataLoader(dataset, **kw)
    if engine == "mosaic":
        from streaming import StreamingDataset

        class Mosaic(StreamingDataset):
            def get_item(self, idx):
                sample = super().get_item(idx)
                return pipeline(sample["image"], sample["label"])

        path = os.path.join(OUT, "mosaic")
        dataset = Mosaic(local=path, batch_size=BATCH, shuffle=True, shuffle_seed=0, num_canonical_nodes=1)
        return torch.utils.data.DataLoader(dataset, **kw)
    import webdataset as wds

    urls = sorted(glob.glob(os.path.join(OUT, "webdataset", "*.tar")))
    dataset = wds.WebDataset(
        urls, shardshuffle=len(urls), seed=0, nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker, empty_check=False,
    ).shuffle(1000, seed=0).map(lambda s: pipeline(s["jpg"], int(s["cls"])))  # fmt: skip
    return torch.utils.data.DataLoader(dataset, **kw)


def main(engine: str, workers: int) -> None:
    torch.set_num_threads(1)
    loader = build(engine, workers)
    for _ in loader:  # the warm-up epoch: workers start, the page cache fills
        pass
    started, images = time.perf_counter(), 0
    for _ in range(2):
        for batch, _labels in loader:
            images += batch.shape[0]
    rate = images / (time.perf_counter() - started)
    print(json.dumps({"engine": engine, "workers": workers, "images_per_sec": rate}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
