"""Presets (``configs/presets/``), model files (``configs/models/``): keys are Megatron-LM argparse destinations."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from lagom_megatron import configs_dir
from lagom_megatron.engine.search import LAGOM_METHODS
from lagom_megatron.engine.tuner import DEFAULT_CONFIG

CONFIGS_DIR, CONFIGS_ORIGIN = configs_dir()
"""Root of the presets, and what chose it: ``$LAGOM_CONFIGS``, the installed copy, or the source ``configs/``."""


class _Section(BaseModel):
    # strict: a quoted "false" is no boolean, "4" no integer; only an integer may stand for a float
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ModelSpec(_Section):
    """Transformer dimensions, with Megatron-LM's argument names and its meaning of None."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    swiglu: bool = False
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    kv_channels: int | None = None
    rotary_base: int | None = None
    add_bias_linear: bool = True
    """False = ``--disable-bias-linear``."""
    moe_ffn_hidden_size: int | None = None
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = None
    moe_grouped_gemm: bool = False


class ParallelSpec(_Section):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False


class TrainingSpec(_Section):
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    seq_length: int = 1024
    train_iters: int = 100
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 1
    bf16: bool = False
    fp16: bool = False


class OverlapSpec(_Section):
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None
    tp_comm_overlap: bool = False
    overlap_p2p_comm: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    use_torch_fsdp2: bool = False
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "no_shard"
    """What Megatron-FSDP shards (optim_grads_params = ZeRO-3); default as Megatron-LM core_v0.16/0.17."""


class DataSpec(_Section):
    mock_data: bool = False
    data_path: list[str] | None = None
    split: str = "969,30,1"
    tokenizer_type: str | None = None


class LagomSpec(_Section):
    lagom: bool = False
    lagom_warmup_iters: int = DEFAULT_CONFIG.warmup_iters
    lagom_verify_iters: int = DEFAULT_CONFIG.verify_iters
    lagom_verify_max_iters: int | None = DEFAULT_CONFIG.verify_max_iters
    lagom_method: Literal[LAGOM_METHODS] = DEFAULT_CONFIG.method  # type: ignore[valid-type]
    lagom_plan: str | None = None
    lagom_report: str | None = None


class SlurmSpec(_Section):
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str | None = None
    account: str | None = None
    time: str = "01:00:00"
    layout: Literal["per-node", "per-gpu"] = "per-node"
    """per-node: one task per node running torchrun; per-gpu: one task per GPU."""


class Preset(_Section):
    """A runnable combination (``load_preset('cpu-tp2-dp2')``); ``to_args()`` gives defaults that flags override."""

    description: str = ""
    model: str | ModelSpec
    cluster: str = "cpu-gloo"
    world_size: int = 1
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec = TrainingSpec()
    overlap: OverlapSpec = OverlapSpec()
    data: DataSpec = DataSpec()
    lagom: LagomSpec = LagomSpec()
    env: dict[str, str] = {}
    """Environment exported to every rank before launch (NCCL_*, CUDA_DEVICE_MAX_CONNECTIONS)."""
    slurm: SlurmSpec | None = None
    name: str = ""
    _path: Path | None = PrivateAttr(None)

    @property
    def ref(self) -> str:
        """What loads this preset again: its name when it is the shipped file of that name, else its file's path."""
        if self._path is None or (CONFIGS_DIR / "presets" / f"{self.name}.yaml").resolve() == self._path.resolve():
            return self.name
        return str(self._path.resolve())

    def model_spec(self) -> ModelSpec:
        """The model dimensions, loading ``configs/models/<model>.yaml`` when ``model`` is a name."""
        if isinstance(self.model, ModelSpec):
            return self.model
        return load_model(self.model)

    def to_args(self) -> dict[str, Any]:
        """Argparse destinations -> values; ``OMIT_WHEN_DEFAULT`` fields only when not at their default."""
        out: dict[str, Any] = {}
        for section in (self.model_spec(), self.parallel, self.training, self.overlap, self.data, self.lagom):
            defaults = type(section).model_fields
            for key, value in section.model_dump().items():
                if key in OMIT_WHEN_DEFAULT and value == defaults[key].default:
                    continue
                out[key] = value
        return out


OMIT_WHEN_DEFAULT: frozenset[str] = frozenset(
    {
        "kv_channels",
        "rotary_base",
        "add_bias_linear",
        "moe_ffn_hidden_size",
        "moe_token_dispatcher_type",
        "moe_grouped_gemm",
        "num_virtual_stages_per_pipeline_rank",
        "expert_tensor_parallel_size",
        "overlap_param_gather_with_optimizer_step",
        "overlap_moe_expert_parallel_comm",
        "use_torch_fsdp2",
        "use_megatron_fsdp",
        "data_parallel_sharding_strategy",
        "lagom_verify_max_iters",
    }
)


def _resolve(kind: str, name_or_path: str | os.PathLike) -> Path:
    p = Path(name_or_path)
    if p.is_dir() and not (CONFIGS_DIR / kind / f"{name_or_path}.yaml").is_file():
        raise ValueError(
            f"{kind[:-1]} {str(p)!r} is a folder; give a {kind[:-1]} YAML file or one of: {', '.join(available(kind))}"
        )
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"{kind} file {str(p)!r} does not exist")
        return p
    candidate = CONFIGS_DIR / kind / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = available(kind)
    close = difflib.get_close_matches(str(name_or_path), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    env = CONFIGS_ORIGIN == "LAGOM_CONFIGS"
    if not known:  # a LAGOM_CONFIGS that names the wrong folder, or an install without its package data
        raise ValueError(
            f"unknown {kind[:-1]} {str(name_or_path)!r}: {CONFIGS_DIR / kind} "
            f"({'from LAGOM_CONFIGS' if env else CONFIGS_ORIGIN}) holds no {kind}"
            + ("; set LAGOM_CONFIGS to a folder with clusters/, models/ and presets/, or unset it" if env else "")
        )
    source = f" (from LAGOM_CONFIGS={CONFIGS_DIR})" if env else ""
    raise ValueError(f"unknown {kind[:-1]} {str(name_or_path)!r}{hint}; available{source}: {', '.join(known)}")


def available(kind: str) -> list[str]:
    """Names of the YAML files under ``configs/<kind>/`` (kind: models, clusters, presets)."""
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    """Reads a YAML mapping; ValueError on malformed YAML (file, line, column), a non-mapping, or a YAML 1.1 word
    (``yes``, ``off``, ...) read as a boolean (key and word named)."""
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        word = next(_yaml11_booleans(node, ()), None)
        if word is not None:
            loc, scalar = word
            read_as = "true" if scalar.value.lower() in ("yes", "on") else "false"
            raise ValueError(
                f"{path}:{scalar.start_mark.line + 1}:{scalar.start_mark.column + 1}: {'.'.join(loc)}: "
                f"{scalar.value!r} is a YAML 1.1 word that PyYAML reads as {read_as}; allowed: true or false "
                f"for a boolean, or the word in quotes for a string"
            )
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}: malformed YAML{where}: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level; got {type(data).__name__}")
    return data


_BOOL_TAG = "tag:yaml.org,2002:bool"


def _yaml11_booleans(node: Any, loc: tuple[str, ...]):
    """(key path, scalar) of each plain scalar the resolver tagged boolean whose text is not true/false."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = (*loc, str(key.value))
            yield from _yaml11_booleans(key, here)
            yield from _yaml11_booleans(value, here)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _yaml11_booleans(item, (*loc, str(i)))
    elif isinstance(node, yaml.ScalarNode) and node.tag == _BOOL_TAG and node.value.lower() not in ("true", "false"):
        yield loc, node


def _validate(cls: type[BaseModel], data: dict[str, Any], path: Path) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = _the_error(exc.errors())
        err["loc"] = tuple(x for x in err["loc"] if x not in _BRANCHES)  # model.ModelSpec.num_layer -> model.num_layer
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ValueError(f"{path}: unknown key {loc!r}; {_closest_key(cls, err['loc'])}") from None
        allowed = "; allowed: true or false" if err["type"] == "bool_type" else ""
        raise ValueError(
            f"{_where(path, err['loc'])}: {loc}: {err['msg']} (got {err.get('input')!r}){allowed}"
        ) from None


def _closest_key(cls: type[BaseModel], loc: tuple) -> str:
    """``did you mean`` the closest key of the same section, or of another one (``training.train_iters`` for a
    top-level ``train_iter``) when that is closer; else the section's valid keys."""
    valid = _valid_keys(cls, loc[:-1])
    word = str(loc[-1])
    scored = [(difflib.SequenceMatcher(None, word, k).ratio(), 1, k) for k in valid]
    scored = [c for c in scored if c[0] >= 0.5]  # difflib.get_close_matches' cutoff, as a user's typo needs
    for key in _dotted_keys(cls, ()):
        if key[:-1] != tuple(loc[:-1]):
            ratio = difflib.SequenceMatcher(None, word, key[-1]).ratio()
            if ratio >= 0.8:  # another section's key: only a near-exact leaf
                scored.append((ratio, 0, ".".join(key)))
    if scored:
        return f"did you mean {max(scored)[2]!r}?"
    return f"valid keys: {', '.join(valid)}"


def _dotted_keys(model: Any, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        out += _dotted_keys(inner[0], (*prefix, name)) if inner else [(*prefix, name)]
    return out


_BRANCHES = ("str", "ModelSpec")  # pydantic's location tags for the branches of ``Preset.model``


def _the_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    first = errors[0]
    if first["loc"][-1:] == ("str",) and isinstance(first.get("input"), dict):
        errors = [
            e for e in errors if e["loc"][: len(first["loc"]) - 1] == first["loc"][:-1] and "ModelSpec" in e["loc"]
        ] or errors
    typos = [e for e in errors if e["type"] == "extra_forbidden"]  # a typo explains the "Field required" of its key
    return dict((typos or errors)[0])


def _where(path: Path, loc: tuple) -> str:
    try:
        node = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError):
        return str(path)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            break
        if node is None:
            return str(path)
    return f"{path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def _valid_keys(cls: type[BaseModel], loc: tuple) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            break
        ann = field.annotation
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            break
        model = candidates[0]
    return sorted(model.model_fields)


def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    """Loads ``configs/models/<name>.yaml`` or a path; ValueError on a bad name, key or type, FileNotFoundError."""
    path = _resolve("models", name_or_path)
    return _validate(ModelSpec, read_yaml(path), path)


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    """Loads ``configs/presets/<name>.yaml`` or a path, with its model; ValueError or FileNotFoundError."""
    path = _resolve("presets", name_or_path)
    preset = _validate(Preset, read_yaml(path), path)
    preset.name = path.stem
    preset._path = path
    preset.model_spec()  # fail now on a bad model reference
    return preset
