"""The README's recipe table restates config defaults: each row's key must exist and its default must be what
`python train.py` composes (a group's row: the option conf/config.yaml chooses)."""

from __future__ import annotations

from helpers import ROOT, compose_cfg
from omegaconf import OmegaConf

from imgtrain.config.validate import validate

README = (ROOT / "README.md").read_text()
HEADING = "## Recipes: what torchvision's and timm's users train with"


def _rows() -> dict[str, str]:
    """Key -> default (backticks stripped) of the first table under HEADING."""
    rows: dict[str, str] = {}
    for line in README.split(HEADING, 1)[1].splitlines():
        if line.startswith("## "):
            break
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0]] = cells[1]
    return rows


def _shown(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def test_the_recipe_table_states_the_defaults() -> None:
    rows = _rows()
    assert len(rows) >= 15, rows
    cfg = compose_cfg()
    settings = validate(cfg)
    choices = {line.split(":")[0].strip(" -"): line.split(":")[1].split("#")[0].strip()
               for line in (ROOT / "conf" / "config.yaml").read_text().splitlines()
               if line.startswith("  - ") and ":" in line}  # fmt: skip
    for key, default in rows.items():
        if "." not in key:
            assert choices.get(key) == default, (
                f"README says {key}={default}, conf/config.yaml chooses {choices.get(key)}"
            )
            continue
        group, name = key.split(".", 1)
        node = getattr(settings, group)
        assert hasattr(node, name), f"README lists {key}, which the schema does not have"
        assert OmegaConf.select(cfg, key) is not None or getattr(node, name) is None
        assert _shown(getattr(node, name)) == default, (
            f"README says {key}={default}, the default is {getattr(node, name)}"
        )
