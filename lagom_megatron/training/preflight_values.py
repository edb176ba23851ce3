"""Pre-flight rule for the value domains that the libraries check only after the process groups exist.

Each of these would otherwise stop every rank with a traceback once training is being set up:

- the optimizer: torch's ``Adam`` / ``AdamW`` refuse lr < 0, eps < 0, betas outside [0, 1) and
  weight decay < 0 when constructed (``torch/optim/adam.py``, ``adamw.py``); megatron-core builds
  the optimizer after ``initialize_model_parallel``;
- ``--seed``: numpy's ``np.random.seed`` accepts 0..2**32 - 1 only, and the loop seeds numpy with it;
- ``--split``: megatron-core's ``parse_and_normalize_split``
  (``megatron/core/datasets/blended_megatron_dataset_config.py:155-172``) takes the numbers of the
  string, at most three, each >= 0, and divides by their sum; the training share must be > 0;
- further sizes that must be >= 1 when given: ``--ffn-hidden-size``, ``--kv-channels``,
  ``--max-position-embeddings``, ``--vocab-size``, ``--make-vocab-size-divisible-by``,
  ``--distributed-timeout-minutes`` (a process-group timeout of zero minutes fails every collective);
- ``--clip-grad`` >= 0 (megatron-core's ``clip_grad_norm_fp32`` scales by ``max_norm / total_norm``:
  a negative value flips every gradient).

The rule reads each flag with a default, so a Megatron-LM line without the flag is not checked for it.
"""

from __future__ import annotations

import re

from lagom_megatron.training.preflight_types import Finding, RunShape

SIZES = ("ffn_hidden_size", "kv_channels", "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by",
         "distributed_timeout_minutes")
SEED_MAX = 2**32 - 1


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rule_values(s: RunShape) -> list[Finding]:
    """The domains of the module docstring; one error per bad flag."""
    out = []

    def bad(dest: str, value: object, allowed: str, why: str) -> None:
        out.append(Finding("error", "values", f"{_flag(dest)} {value!r} is out of range; allowed: {allowed}", why,
                           f"give {_flag(dest)} a value in {allowed}"))

    adam = "torch.optim.Adam refuses it when megatron-core builds the optimizer (torch/optim/adam.py)"
    for dest, allowed, ok in (("lr", ">= 0", lambda v: v >= 0), ("min_lr", ">= 0", lambda v: v >= 0),
                              ("adam_eps", ">= 0", lambda v: v >= 0), ("weight_decay", ">= 0", lambda v: v >= 0),
                              ("adam_beta1", "[0, 1)", lambda v: 0 <= v < 1), ("adam_beta2", "[0, 1)", lambda v: 0 <= v < 1),
                              ("clip_grad", ">= 0", lambda v: v >= 0)):
        value = s.args.get(dest)
        if _number(value) and not ok(value):
            bad(dest, value, allowed, adam if dest != "clip_grad" else
                "gradient clipping scales by max_norm / norm; a negative bound flips the gradients")
    seed = s.args.get("seed")
    if _number(seed) and not (isinstance(seed, int) and 0 <= seed <= SEED_MAX):
        bad("seed", seed, f"0..{SEED_MAX}", "numpy's np.random.seed refuses anything else when the loop seeds it")
    for dest in SIZES:
        value = s.args.get(dest)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            bad(dest, value, "an integer >= 1", "a size of zero or less breaks the model or the process groups")
    split = s.args.get("split")
    if isinstance(split, str):
        parts = [float(x) for x in re.findall(r"[.0-9]+", split) if x != "."]
        if not parts or len(parts) > 3 or "-" in split or sum(parts) <= 0 or parts[0] <= 0:
            bad("split", split, "up to three weights >= 0, e.g. 969,30,1, with a training weight > 0",
                "megatron-core's parse_and_normalize_split asserts three parts >= 0 and divides by their sum "
                "(blended_megatron_dataset_config.py:155-172)")
    return out
