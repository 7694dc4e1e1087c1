"""The README's "Using it" example runs as written (it once converted an already converted
model and used names it never defined)."""
import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def using_it_example() -> str:
    section = README.read_text().split("## Using it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_using_it_example_runs(capsys):
    namespace = {}
    exec(compile(using_it_example(), "README.md (Using it)", "exec"), namespace)
    assert "FP8Linear layers" in capsys.readouterr().out
    model, other = namespace["model"], namespace["other"]
    assert type(model["mlp"][0]).__name__ == "FP8Linear" and type(model["lm_head"]) is torch.nn.Linear
    assert other["mlp"][2].config.weight_granularity == "channel"
    assert namespace["y"].shape == (8, 1024) and namespace["y"].dtype == torch.bfloat16
