"""dataset.augment's policies and dataset.random_erasing (data/policies.py): torchvision's reference recipe in one
Compose, run after the batched crop (the policy per sample, erasing per batch), each draw a function of the
sample's seed alone, erasing on the device giving the workers' pixels, the time in the `augment` stage, the
combinations refused in one line, and the verdict of an augment-bound run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_cfg
from hydra.errors import HydraException
from hydra.utils import instantiate
from torchvision.transforms import v2

from imgtrain.common.errors import ConfigError
from imgtrain.config.data import DataConfig
from imgtrain.config.fields import AugmentOn
from imgtrain.config.validate import validate
from imgtrain.data import batched, policies, stages
from imgtrain.data.datasets import (
    TensorImageDataset,
    build_shapes,
    build_synthetic,
    imagenet_transforms,
    mean_levels,
    train_transform,
)
from imgtrain.data.feed import Feed
from imgtrain.data.loader import plan_loader
from imgtrain.data.pipeline import build_loader
from imgtrain.data.samples import GuardedSamples, RawBatch, collate
from imgtrain.metrics import report
from imgtrain.train.cli import one_line
from imgtrain.train.run import run

POLICIES = ("trivialaugment", "randaugment", "autoaugment")
DRAWS = 4000  # erasing boxes per distribution, as tests/test_batched.py's crops
P_MIN = 1e-3


def _shapes(root: Path, count: int = 40, **keys):
    return build_shapes(
        "shapes", 32, [0.5] * 3, [0.25] * 3, keys.pop("augment", "rrc_flip"), str(root), count, 10, 0, **keys
    )


@pytest.fixture(scope="module")
def decoded(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    bundle = _shapes(tmp_path_factory.mktemp("s"), count=64)
    return [bundle.train.decoded(i)[0] for i in range(64)]


def test_the_training_transform_is_the_reference_recipe_in_one_compose() -> None:
    train, val = imagenet_transforms(224, None, "randaugment", randaugment_ops=3, randaugment_magnitude=5,
                                     random_erasing=0.25, mean=[0.485, 0.456, 0.406])  # fmt: skip
    kinds = [type(step) for step in train.transforms]
    assert kinds == [v2.RandomResizedCrop, v2.RandomHorizontalFlip, v2.RandAugment, v2.RandomErasing]
    assert (train.transforms[2].num_ops, train.transforms[2].magnitude) == (3, 5)
    assert train.transforms[3].p == 0.25 and train.transforms[3].value == [124.0, 116.0, 104.0]
    assert [type(step) for step in val.transforms] == [v2.Resize, v2.CenterCrop]
    trivial, _ = imagenet_transforms(224, None, "trivialaugment")
    assert isinstance(trivial.transforms[-1], v2.TrivialAugmentWide) and len(trivial.transforms) == 3
    auto, _ = imagenet_transforms(224, None, "autoaugment")
    assert auto.transforms[-1].policy == v2.AutoAugmentPolicy.IMAGENET
    plain, val = imagenet_transforms(224, None, "none")
    assert plain is val  # augment=none: the validation transform
    erased, _ = imagenet_transforms(224, None, "none", random_erasing=0.5)
    assert [type(step) for step in erased.transforms] == [v2.Resize, v2.CenterCrop, v2.RandomErasing]
    assert mean_levels([0.5, 0.5, 0.5]) == [128, 128, 128]


def test_spec_of_peels_the_policy_and_the_erasing_off_the_batched_crop() -> None:
    transform = train_transform(32, min_scale=0.6, augment="trivialaugment", random_erasing=0.5, mean=[0.5] * 3)
    spec = batched.spec_of(transform)
    assert (spec.size, spec.scale, spec.flip_p) == (32, (0.6, 1.0), 0.5)
    assert spec.policy == (transform.transforms[2],)
    assert spec.erasing == policies.ErasingSpec(0.5, (0.02, 0.33), (0.3, 3.3), (128.0, 128.0, 128.0))
    assert batched.spec_of(train_transform(32, random_erasing=0.1)).policy == ()  # erasing alone: no policy
    crop, flip = v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()
    jitter = v2.ColorJitter(0.4)
    assert batched.spec_of(v2.Compose([crop, flip, jitter])).policy == (jitter,)  # a fork's own policy step
    noise = v2.RandomErasing(value="random")  # noise fill: per sample, as part of the policy
    assert batched.spec_of(v2.Compose([crop, flip, noise])) == batched.CropSpec(32, (0.08, 1.0), flip_p=0.5,
                                                                                policy=(noise,))  # fmt: skip
    assert batched.spec_of(v2.Compose([crop, flip, jitter, v2.RandomCrop(24)])) is None  # resizes after the crop


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policys_draws_depend_on_each_seed_alone_and_change_the_images(decoded, policy) -> None:
    spec = batched.spec_of(train_transform(32, min_scale=0.6, augment=policy))
    seeds = np.arange(500, 564)
    state = torch.random.get_rng_state()
    whole = torch.stack(batched.augment_batch(decoded, seeds, spec))
    assert torch.equal(torch.random.get_rng_state(), state)  # the training process's own stream is untouched
    halves = [
        *batched.augment_batch(decoded[:20], seeds[:20], spec),
        *batched.augment_batch(decoded[20:], seeds[20:], spec),
    ]
    assert torch.equal(whole, torch.stack(halves))  # whatever the batch
    reversed_batch = batched.augment_batch(decoded[::-1], seeds[::-1], spec)
    assert torch.equal(whole, torch.stack(reversed_batch[::-1]))  # whatever the order in it
    crops = torch.stack(batched.augment_batch(decoded, seeds, batched.spec_of(train_transform(32, min_scale=0.6))))
    changed = (whole != crops).flatten(1).any(1).float().mean()
    assert changed > 0.5  # not a no-op (some images draw the identity or a mild operation)
    other = torch.stack(batched.augment_batch(decoded, seeds + 1, spec))
    assert (other != whole).flatten(1).any(1).float().mean() > 0.9  # another seed: other draws


def test_the_crop_the_policy_and_the_erasing_draw_independently() -> None:
    """Three parts of each seed's one stream: no draw of one is correlated with a draw of another."""
    seeds = np.arange(4000) * 7919
    crop = policies.uniforms(seeds, batched.DRAWS)
    policy = policies.uniforms(seeds, 1, policies.POLICY_DRAW)
    erasing = policies.uniforms(seeds, policies.ERASING_DRAWS, policies.ERASING_FIRST)
    table = np.corrcoef(np.concatenate([crop, policy, erasing], axis=1).T)
    np.fill_diagonal(table, 0.0)
    assert np.abs(table).max() < 0.07  # 4000 draws: a correlation's standard error is 0.016


@pytest.mark.parametrize("place", [AugmentOn.auto, AugmentOn.device])
def test_a_policy_keeps_the_crop_in_the_workers(tmp_path: Path, place: AugmentOn) -> None:
    bundle = _shapes(tmp_path, augment="trivialaugment")  # 32 px images, 32 px crops: auto would ship them
    batch = collate(GuardedSamples(bundle.train, augment_on=place).__getitems__([(i, i) for i in range(4)]))
    assert isinstance(batch.images, torch.Tensor) and batch.images.shape == (4, 3, 32, 32)


def test_a_policy_gives_the_same_images_in_workers_and_in_the_training_process(tmp_path: Path) -> None:
    """The policy's seeding in a worker (the generator re-seeded per sample) and in the training process (forked):
    the same batches, and a new epoch draws anew."""
    bundle = _shapes(tmp_path, augment="trivialaugment", random_erasing=0.5)

    def epoch(workers: int, number: int) -> torch.Tensor:
        data = DataConfig(num_workers=workers, batch_size=8, persistent_workers=False)
        loader = build_loader(bundle.train, plan_loader(data, train=True, device_type="cpu"), train=True, seed=3)
        loader.sampler.set_epoch(number)
        return torch.cat([batch.images for batch in loader])

    reference = epoch(0, 0)
    assert torch.equal(reference, epoch(1, 0))
    assert not torch.equal(reference, epoch(0, 1))


def test_erasing_boxes_follow_random_erasings_distribution() -> None:
    spec = policies.ErasingSpec(0.5, (0.02, 0.33), (0.3, 3.3), (0.0,))
    ours = policies.erase_boxes(np.arange(DRAWS), spec, 64)
    image, theirs = torch.empty(3, 64, 64, dtype=torch.uint8), []
    erasing = v2.RandomErasing(p=1.0)
    torch.manual_seed(0)
    for _ in range(DRAWS):
        params = erasing.make_params([image])
        theirs.append([params["i"], params["j"], params["h"], params["w"]] if torch.rand(1) < 0.5 else [0] * 4)
    theirs = np.array(theirs)
    ks_2samp = pytest.importorskip("scipy.stats", reason="needs SciPy (the dev extra)").ks_2samp
    assert abs((ours[:, 2] > 0).mean() - 0.5) < 0.03 and abs((theirs[:, 2] > 0).mean() - 0.5) < 0.03
    a, b = ours[ours[:, 2] > 0], theirs[theirs[:, 2] > 0]
    assert (a[:, 0] + a[:, 2] <= 64).all() and (a[:, 1] + a[:, 3] <= 64).all() and (a[:, 2:] < 64).all()
    for name, feature in {
        "area": lambda x: x[:, 2] * x[:, 3],
        "aspect": lambda x: x[:, 2] / x[:, 3],
        "top": lambda x: x[:, 0] + x[:, 2] / 2,
        "left": lambda x: x[:, 1] + x[:, 3] / 2,
    }.items():
        assert ks_2samp(feature(a), feature(b)).pvalue > P_MIN, name
    narrower = policies.erase_boxes(np.arange(DRAWS), policies.ErasingSpec(1.0, (0.05, 0.33), (0.3, 3.3), (0,)), 64)
    assert ks_2samp(narrower[:, 2] * narrower[:, 3], b[:, 2] * b[:, 3]).pvalue < 1e-6  # the test can fail


def test_erasing_on_the_device_gives_the_workers_pixels(tmp_path: Path) -> None:
    """data.augment_on=device with random erasing: the boxes travel with the RawBatch and are filled after the
    crop; inside them the pixels are the workers' exactly (the mean's levels), outside within the crop's bound."""
    bundle = _shapes(tmp_path, random_erasing=0.9)
    items = [(i, 1000 + i) for i in range(8)]

    def batch(place: AugmentOn):
        return collate(GuardedSamples(bundle.train, augment_on=place).__getitems__(items))

    raw, cropped = batch(AugmentOn.device), batch(AugmentOn.workers)
    assert isinstance(raw.images, RawBatch) and raw.images.erase.shape == (8, 4) and raw.images.fill == (128.0,) * 3
    on_device = raw.images.resampled()
    boxes = raw.images.erase
    mask = policies.erase_masked(torch.zeros(8, 1, 32, 32), boxes, [1.0])[:, 0].bool()
    assert 1 <= mask.flatten(1).any(1).sum() <= 8 and mask.sum() > 0
    inside = mask[:, None].expand(-1, 3, -1, -1)
    assert torch.equal(on_device[inside], cropped.images[inside].float())
    assert (on_device[inside] == 128).all()
    outside = (on_device - cropped.images.float()).abs()[~inside]
    assert outside.mean() <= 0.5 and outside.quantile(0.99) <= 2  # tests/test_batched.py's bound for roi_align
    again = batch(AugmentOn.device)
    assert torch.equal(
        collate(GuardedSamples(bundle.train, augment_on=AugmentOn.device).__getitems__(items[4:])).images.erase,
        again.images.erase[4:],
    )
    feed = Feed.build(
        bundle, torch.device("cpu"), torch.contiguous_format, pinned=False, prefetch=False, gpu_decode=False
    )
    normalised = feed.to_model(raw)[0]
    assert normalised[inside].abs().max() < 0.01  # the mean's nearest level: about 0 after normalisation


def test_the_masked_fill_and_the_slices_erase_the_same_pixels() -> None:
    images = torch.randint(0, 256, (16, 3, 48, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    boxes = torch.from_numpy(
        policies.erase_boxes(np.arange(16), policies.ErasingSpec(0.7, (0.02, 0.33), (0.3, 3.3), (1.0, 2.0, 3.0)), 48)
    )
    masked = policies.erase_masked(images.clone(), boxes, (1.0, 2.0, 3.0))
    assert torch.equal(masked, policies.erase_slices(images.clone(), boxes, (1.0, 2.0, 3.0)))
    assert not torch.equal(masked, images) and torch.equal(masked[boxes[:, 2] == 0], images[boxes[:, 2] == 0])


class Slow(torch.nn.Module):
    """A policy step of known cost: its time must land in the augment stage, not in collate."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return image


def test_the_policys_time_lands_in_the_augment_stage(tmp_path: Path) -> None:
    bundle = _shapes(tmp_path, random_erasing=0.5)
    bundle.train.transform = v2.Compose(
        [*bundle.train.transform.transforms[:2], Slow(), bundle.train.transform.transforms[-1]]
    )
    assert batched.spec_of(bundle.train.transform).policy and batched.spec_of(bundle.train.transform).erasing
    times: stages.BatchTimes = collate(GuardedSamples(bundle.train).__getitems__([(i, i) for i in range(8)])).times
    assert times.augment >= 8 * 0.004 and times.collate < 0.004 and times.busy >= times.augment + times.decode


def test_in_memory_datasets_take_the_policy_after_their_own_steps() -> None:
    bundle = build_synthetic("synthetic", 32, [0.5] * 3, [0.25] * 3, "autoaugment", 16, 4, 2, 0, random_erasing=0.5)
    assert [type(step) for step in bundle.train.transform.transforms] == [v2.AutoAugment, v2.RandomErasing]
    assert isinstance(bundle.train, TensorImageDataset) and not bundle.train.batchable  # per sample
    samples = GuardedSamples(bundle.train)
    items = [(i, 70 + i) for i in range(8)]
    first = collate(samples.__getitems__(items)).images
    assert torch.equal(collate(samples.__getitems__(items[4:])).images, first[4:])
    assert not torch.equal(first, bundle.train.images[:8])


def test_every_builder_takes_the_policy_keys_from_the_config(data_dir: Path) -> None:
    keys = ["dataset.augment=randaugment", "dataset.randaugment_ops=1", "dataset.random_erasing=0.2"]
    for dataset in ("shapes", "synthetic"):
        settings = validate(compose_cfg(f"dataset={dataset}", *keys, "dataset.num_train=16", "dataset.num_val=4"))
        steps = instantiate(settings.dataset, _convert_="all").train.transform.transforms
        assert isinstance(steps[-2], v2.RandAugment) and steps[-2].num_ops == 1 and steps[-1].p == 0.2


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["dataset.augment=trivialaugment", "data.augment_on=device"],
            "data.augment_on=device does not combine with dataset.augment=trivialaugment",
        ),
        (
            ["dataset.random_erasing=0.25", "data.device_resident=true"],
            "data.device_resident=true crops and flips only, not dataset.random_erasing=0.25",
        ),
        (["dataset.augment=autoaugment", "data.device_resident=true"], "not dataset.augment=autoaugment"),
    ],
)
def test_what_cannot_run_where_the_data_keys_put_it_is_one_line(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        validate(compose_cfg(*overrides))
    validate(compose_cfg("dataset.random_erasing=0.25", "data.augment_on=device"))  # erasing can go to the device


def test_decoding_on_the_gpu_refuses_a_policy(tmp_path: Path) -> None:
    args = ["dataset=imagefolder", f"dataset.root={tmp_path}", "dataset.decode=cuda"]
    with pytest.raises(
        ConfigError, match="dataset.decode=cuda crops and flips on the GPU only, not dataset.augment=randaugment"
    ):
        validate(compose_cfg(*args, "dataset.augment=randaugment"))


def test_the_former_boolean_says_its_new_value_and_the_choices() -> None:
    for value, now in (("false", "none"), ("true", "rrc_flip")):
        with pytest.raises(HydraException) as caught:
            compose_cfg(f"dataset.augment={value}")
        line = one_line(caught.value)
        assert line.startswith(f"dataset.augment={value} is now dataset.augment={now}; ") and "\n" not in line
        assert "none, rrc_flip, trivialaugment, randaugment, autoaugment" in line


def _augment_bound(**extra) -> dict:
    per_image = dict.fromkeys(stages.STAGES) | {"read": 0.1, "decode": 0.8, "augment": 2.6, "collate": 0.05}
    pipeline = {"stage_ms_per_image": per_image, "worker_busy_frac": 0.95, "worker_busy_cores": 3.8}
    pipeline |= {"transfer_frac_of_wait": 0.05, "workers": 4, "compute_images_per_sec": None}
    loader = {"num_workers": 4, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2}
    loader |= {"augment_on": "auto"} | extra.pop("loader", {})
    summary = {"mode": "train", "data_wait_frac": 0.5, "loader": loader, "world_size": 1, "local_world_size": 1}
    return summary | {"cpu_count": 16, "device": "cuda:0", "pipeline": pipeline, "dataset": "imagefolder"} | extra


def test_an_augment_bound_verdict_names_augment_and_what_the_policy_allows() -> None:
    policy = report.verdict(_augment_bound(dataset_augment="trivialaugment"))
    assert "augment takes the most input time (2.60 of 3.55 ms per image)" in policy
    assert "data.num_workers=8" in policy  # CPUs are free: more workers first
    assert "a cheaper dataset.augment than trivialaugment" in policy and "augment_on=device" not in policy
    plain = report.verdict(_augment_bound(dataset_augment="rrc_flip"))
    assert "augmenting on the GPU (data.augment_on=device)" in plain and "cheaper dataset.augment" not in plain
    there = report.verdict(_augment_bound(dataset_augment="rrc_flip", loader={"augment_on": "device"}, cpu_count=5))
    assert "augment_on=device" not in there and "num_workers" not in there
    assert report.bounding_stage(_augment_bound(dataset_augment="randaugment")) == "augment"
    unknown = report.verdict(_augment_bound(cpu_count=5))  # an older metrics.json: no dataset_augment
    assert (
        "data.augment_on=device, with dataset.augment=rrc_flip or none" in unknown
        and "a cheaper dataset.augment" in unknown
    )


@pytest.mark.slow
def test_a_run_with_a_policy_and_erasing_trains_and_reruns_bit_identically(tmp_path: Path, data_dir: Path) -> None:
    """The whole loop with trivialaugment and random erasing in a worker: it trains, the policy's time shows in the
    augment stage, and a deterministic rerun gives the same weights to the bit (each draw from its sample's seed)."""
    args = ["debug=fast", "dataset.augment=trivialaugment", "dataset.random_erasing=0.5", "system.deterministic=true"]
    values = []
    for name in ("first", "again"):
        run(compose_cfg(*args, "train.max_steps=3", output_dir=str(tmp_path / name)))
        values.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    assert values[0]["steps"] == 3 and values[0]["pipeline"]["stage_ms_per_image"]["augment"] > 0
    assert (values[0]["val_loss"], values[0]["val_acc"]) == (values[1]["val_loss"], values[1]["val_acc"])
    weights = [
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=False)["model"]
        for name in ("first", "again")
    ]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
