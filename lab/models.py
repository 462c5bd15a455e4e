"""Routed-expert shapes of published NVFP4 MoE models, as presets for the scripts' `--model`.

Only the routed experts are the lab's layer: shared experts and dense layers are left out of
every figure (a checkpoint reader skips them too, lab/checkpoint.py). Each number below names
the config.json field it comes from on Hugging Face; NVIDIA's NVFP4 releases of these models
(nvidia/DeepSeek-R1-FP4, nvidia/Qwen3-235B-A22B-FP4, nvidia/Qwen3-30B-A3B-FP4,
nvidia/Llama-4-Maverick-17B-128E-Instruct-FP4) keep the base models' shapes.

    add_shape_arguments(ap)     --model, --experts, --hidden, --intermediate, --top-k
    resolve_shape(args, ap)     the preset, then any explicit flag over it; --model list prints
                                the table and exits
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tabulate import tabulate

from .problem import MoEProblem


@dataclass(frozen=True)
class ModelShape:
    name: str
    experts: int  # routed experts per MoE layer
    hidden: int  # H
    intermediate: int  # I: each routed expert's own intermediate size
    top_k: int  # routed experts per token
    source: str  # where the four numbers come from, printed by --model list

    def problem(self) -> MoEProblem:
        return MoEProblem(self.experts, self.hidden, self.intermediate, self.top_k)


_STUDY = MoEProblem()

MODELS: dict[str, ModelShape] = {m.name: m for m in (
    # The study's own shape: lab/problem.MoEProblem's defaults (the checkpoint it was taken from
    # has 288 routed experts); the figures in results/ and notes/ are at this shape.
    ModelShape("study", _STUDY.experts, _STUDY.hidden, _STUDY.intermediate, _STUDY.top_k,
               "lab/problem.MoEProblem defaults (the study's checkpoint)"),
    # deepseek-ai/DeepSeek-V3 config.json (DeepSeek-R1 shares it): n_routed_experts 256,
    # hidden_size 7168, moe_intermediate_size 2048, num_experts_per_tok 8 (plus n_shared_experts 1
    # and first_k_dense_replace 3 dense layers, neither of them routed).
    ModelShape("deepseek-v3", 256, 7168, 2048, 8,
               "deepseek-ai/DeepSeek-V3 config.json: n_routed_experts, hidden_size, moe_intermediate_size, "
               "num_experts_per_tok (DeepSeek-R1: the same)"),
    # Qwen/Qwen3-235B-A22B config.json: num_experts 128, hidden_size 4096,
    # moe_intermediate_size 1536, num_experts_per_tok 8 (no shared expert).
    ModelShape("qwen3-235b-a22b", 128, 4096, 1536, 8,
               "Qwen/Qwen3-235B-A22B config.json: num_experts, hidden_size, moe_intermediate_size, "
               "num_experts_per_tok"),
    # Qwen/Qwen3-30B-A3B config.json: num_experts 128, hidden_size 2048,
    # moe_intermediate_size 768, num_experts_per_tok 8.
    ModelShape("qwen3-30b-a3b", 128, 2048, 768, 8,
               "Qwen/Qwen3-30B-A3B config.json: num_experts, hidden_size, moe_intermediate_size, "
               "num_experts_per_tok"),
    # meta-llama/Llama-4-Maverick-17B-128E-Instruct config.json, text_config: num_local_experts
    # 128, hidden_size 5120, intermediate_size 8192 (the experts'; intermediate_size_mlp 16384 is
    # the dense layers'), num_experts_per_tok 1 (plus one shared expert; MoE every other layer).
    ModelShape("llama-4-maverick", 128, 5120, 8192, 1,
               "meta-llama/Llama-4-Maverick-17B-128E-Instruct config.json text_config: num_local_experts, "
               "hidden_size, intermediate_size, num_experts_per_tok"),
)}
ALIASES = {"deepseek-r1": "deepseek-v3"}  # same routed-expert shape, another name users type
DEFAULT_MODEL = "study"
SHAPE_FIELDS = ("experts", "hidden", "intermediate", "top_k")


def model(name: str) -> ModelShape:
    """The preset called `name` (case-insensitive, aliases accepted); ValueError naming the known ones."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(f"--model: unknown {name!r}; known: {', '.join([*MODELS, *ALIASES])} (or 'list')")
    return MODELS[key]


def table() -> str:
    """The presets as `--model list` prints them."""
    rows = [[m.name + "".join(f" (= {a})" for a, t in ALIASES.items() if t == m.name), m.experts, m.hidden,
             m.intermediate, m.top_k, m.source] for m in MODELS.values()]
    return tabulate(rows, headers=["model", "experts", "hidden", "intermediate", "top-k", "source"],
                    disable_numparse=True)


def add_shape_arguments(ap: argparse.ArgumentParser, default_from: str = "") -> None:
    """Add --model and the four shape flags with their help text, so every script documents them
    alike. Shape flags default to None: resolve_shape tells a flag given from a preset's value.

    ``default_from``: words after "default: the model's" in each flag's help (e.g. ", or the
    checkpoint's").
    """
    tail = f"default: the model's{default_from}"
    ap.add_argument("--model", metavar="NAME",
                    help=f"routed-expert shape of a published model: {', '.join(MODELS)} ('list' prints "
                         f"them with their sources); --experts/--hidden/--intermediate/--top-k override it "
                         f"(default {DEFAULT_MODEL}: {_STUDY.experts} x {_STUDY.hidden} x {_STUDY.intermediate}, "
                         f"top {_STUDY.top_k})")
    ap.add_argument("--experts", type=int, metavar="E", help=f"routed experts ({tail})")
    ap.add_argument("--hidden", type=int, metavar="H", help=f"hidden size H, a multiple of 64 ({tail})")
    ap.add_argument("--intermediate", type=int, metavar="I",
                    help=f"each expert's intermediate size I, a multiple of 64 ({tail})")
    ap.add_argument("--top-k", type=int, metavar="K", help=f"experts each token is routed to, at most E ({tail})")


def flag(field: str) -> str:
    """The command-line flag of a MoEProblem field: top_k -> --top-k."""
    return "--" + field.replace("_", "-")


def given_shape(args) -> dict:
    """The shape fields set explicitly on the command line (not None)."""
    return {f: getattr(args, f) for f in SHAPE_FIELDS if getattr(args, f, None) is not None}


def resolve_shape(args, ap: argparse.ArgumentParser | None = None, clamp_top_k: bool = False) -> MoEProblem:
    """The problem the flags ask for: the preset (--model, else the study's), each shape flag
    given over it. Fills args.experts etc. with the result. `--model list` prints the presets
    and exits 0 (through `ap`); a bad name or shape exits 2 naming the flag (or raises
    ValueError when no parser is given). ``clamp_top_k``: a preset's top-k larger than the
    experts asked for becomes the expert count (for scripts where top-k only labels the
    output), where an explicit --top-k larger than --experts is still refused."""
    try:
        if getattr(args, "model", None) == "list":
            print(table())
            if ap is not None:
                ap.exit(0)
            raise SystemExit(0)
        preset = model(args.model or DEFAULT_MODEL)
        for f in SHAPE_FIELDS:
            v = getattr(args, f, None)
            if v is not None and v < 1:
                raise ValueError(f"{flag(f)}: must be >= 1, got {v}")
        given = given_shape(args)
        shape = {f: getattr(preset, f) for f in SHAPE_FIELDS} | given
        if clamp_top_k and getattr(args, "top_k", None) is None:
            shape["top_k"] = min(shape["top_k"], shape["experts"])
        # the user reads the flag to change, or the preset a value came from, not a field name
        names = {f: flag(f) if f in given else f"the {preset.name} model's {f}" for f in SHAPE_FIELDS}
        problem = MoEProblem(**shape).validate(names)
    except ValueError as exc:
        if ap is None:
            raise
        ap.error(str(exc))
    for f in SHAPE_FIELDS:
        setattr(args, f, getattr(problem, f))
    return problem
