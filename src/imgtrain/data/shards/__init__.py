"""dataset=shards: image folders packed into LitData shards (`convert`, the `imgtrain-shards` command) and streamed
from a directory or S3-compatible object storage (`dataset`), with the manifest (`manifest`) that says a
conversion finished and what a split may hold, the stores (`store`), the converter's staging folder and stops
(`staging`), what it finds at its destination (`destination`), its options (`arguments`), `--max-side`
(`downscale`) and LitData's settings (`engine`)."""
