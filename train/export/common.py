"""What the export formats share: their error, reading sources, writing the out dir atomically."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.core.atomic import staged_dir
from train.core.config import fail, from_group
from train.core.errors import AlreadyExists, ConfigError, NotFound
from train.heads import HeadConfig


class FormatError(ConfigError):
    """Heads cannot be written in, or read from, a format without changing their proposals."""


@dataclass
class Parsed:
    """A source checkpoint in our terms, before it is checked against a base."""

    head: HeadConfig
    hidden_size: int
    vocab_size: int
    state: dict[str, torch.Tensor]  # our parameter names
    base_id: str  # what the source says it was trained on
    base_shape: dict | None = None  # hf: the recorded shape (Hydra++ layers copy it)
    recorded_base: dict | None = None  # hf: the recorded BaseConfig
    extra: dict | None = None  # hf: the source's own meta, kept where ours has no value


@dataclass
class SameAs:
    name: str


# -- writing -------------------------------------------------------------------------------
def check_out(out: Path, source: Path, overwrite: bool) -> None:
    o, s = out.resolve(), source.resolve()
    if o == s or o in s.parents:
        fail("out", str(out), f"it would replace the input {source}; choose another directory")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise AlreadyExists(f"{out} already exists: pass overwrite=true to replace it")


def write_dir(out: Path, files: dict[str, Any]) -> list[str]:
    """Write `files` (name -> text | tensor dict | `Path` | `SameAs`) into `out`, atomically."""
    from safetensors.torch import save_file

    with staged_dir(out) as tmp:
        for name, content in files.items():
            path = tmp / name
            if isinstance(content, str):
                path.write_text(content)
            elif isinstance(content, SameAs):
                try:  # a hard link: the same bytes under a second name, at no extra space
                    os.link(tmp / content.name, path)
                except OSError:
                    shutil.copyfile(tmp / content.name, path)
            elif isinstance(content, Path):
                shutil.copyfile(content, path)
            elif name.endswith(".safetensors"):
                save_file(plain_state(content), str(path), metadata={"format": "pt"})
            elif name.endswith(".pt"):
                torch.save(plain_state(content), path)
            else:
                raise ValueError(f"no writer for {name}")
    return sorted(files)


def plain_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage; every entry gets its own.
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def head_config(arch: str, **settings: Any) -> HeadConfig:
    return from_group(HeadConfig, "head", arch, **settings)


def zero_bias(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    # the bias `key` of a layer that has none, sized by the weight beside it in `state`
    weight = state[key.removesuffix("bias") + "weight"]
    return weight.new_zeros(weight.shape[0])


# -- reading -------------------------------------------------------------------------------
def read_json(path: Path) -> dict:
    if not path.is_file():
        raise NotFound(f"{path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} holds a {type(data).__name__}, expected a JSON object")
    return data


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a `.safetensors` file, or of a `torch.save`d plain state dict."""
    if not path.is_file():
        raise NotFound(f"{path} not found: is this the right src= and format=?")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise FormatError(
                f"{path} is truncated or corrupt ({type(e).__name__}: {e}); copy or download it "
                "again, or export it again from the checkpoint it came from"
            ) from None
    try:  # weights_only: a checkpoint from elsewhere must not run code when read
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means "not a plain state dict"
        raise FormatError(f"{path} is not a plain state dict of tensors ({e})") from None
    if not isinstance(state, dict):
        raise FormatError(f"{path} holds a {type(state).__name__}, expected a state dict")
    return state


def as_int(cfg: dict, key: str, default: int | None, where: Path) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where}: {key} = {value!r}, expected an integer")
    return value


class Take:
    """Pops tensors from a weights file; names what is missing and what is left over."""

    def __init__(self, path: Path, where: Path | None = None, strip: str = ""):  # where: in errors
        self.state = {k.removeprefix(strip): v for k, v in load_state(path).items()}
        self.where = where or path

    def __call__(self, key: str, optional: bool = False) -> torch.Tensor | None:
        if key in self.state:
            return self.state.pop(key)
        if optional:
            return None
        raise FormatError(f"{self.where} has no tensor {key!r}; is this the right format=?")

    def done(self, ignore: tuple[str, ...] = (), ignore_suffix: str | None = None) -> None:
        left = sorted(
            k
            for k in self.state
            if k not in ignore and not (ignore_suffix and k.endswith(ignore_suffix))
        )
        if left:
            more = f" and {len(left) - 5} more" if len(left) > 5 else ""
            raise FormatError(
                f"{self.where} has tensors these heads have no place for: "
                f"{', '.join(left[:5])}{more}; is this the right format=?"
            )
