"""``memlab estimate``: will this model's training fit on that GPU? Offline, for a model nobody has
downloaded: a Hugging Face ``config.json`` (or its folder), or a torchvision / timm model name.

A thin shell over :mod:`memlab.integrations.training`: the model is built from its config under the
estimate's fake mode (no weights, no data: a 70B model takes a few hundred MiB of host memory), one
training step is estimated on the GPU modelled, and the answer is printed beside the closed-form
numbers users know (:mod:`memlab.integrations.formulas`), as text or as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from memlab._gpus import GPU, GPUS, resolve_gpu
from memlab._progress import Progress
from memlab._units import format_size, parse_size
from memlab.commands._command import CommandError, whole_number
from memlab.history import categories

__all__ = ["EstimateCommand"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The categories shown, in order, with the words the breakdown uses; the rest are summed as "other".
_SHOWN = {
    categories.PARAMETER: "parameters",
    categories.GRADIENT: "gradients",
    categories.OPTIMIZER_STATE: "optimizer state",
    categories.ACTIVATION: "activations",
    categories.TEMPORARY: "temporaries",
    categories.WORKSPACE: "workspaces",
}


class EstimateCommand:
    """``memlab estimate CONFIG_OR_MODEL [--batch-size N] [--seq-len N] [--gpu GPU] [--dtype D]
    [--autocast bf16|fp16] [--optimizer O] [--gradient-checkpointing] [--world-size N (--fsdp |
    --ddp)] [--steps N] [--max-batch-size] [--plan] [--json]``."""

    help = "estimate a training step of a model from its config (no download, no GPU): will it fit?"
    plan_word = "--plan"  # how errors name the plan (the plan command has no --plan to name)

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Estimate the GPU memory of training steps of a model built from a Hugging Face config.json "
            "(or the folder holding it) or a torchvision/timm model name, without weights, data or a GPU: "
            "the model is built data-free (fake tensors) and one step (forward, backward, optimizer step) "
            "runs through memlab's model of the CUDA caching allocator. Prints the peaks, what they hold, "
            "whether they fit on the GPU, and the closed-form numbers (params x bytes per parameter) "
            "beside them."
        )
        parser.epilog = (
            "Sizes are bytes as the CUDA caching allocator counts them (G = GiB). Not seen: the CUDA context "
            "(a GPU's budget here is its memory less 512 MiB for it), cuDNN workspaces, NCCL buffers. The "
            "numbers include the cuBLAS workspaces PyTorch allocates on that GPU (the first line says how "
            "many and their size); CUBLAS_WORKSPACE_CONFIG=:0:0 in the environment turns them off, as it "
            "does in PyTorch. Fits means: the steps complete under a caching allocator capped at the "
            "budget, which frees its cache and retries before it runs out of memory."
        )
        parser.add_argument(
            "model",
            metavar="CONFIG_OR_MODEL",
            help="a config.json, a folder holding one, or a torchvision/timm model name",
        )
        parser.add_argument(
            "--batch-size",
            metavar="N",
            type=whole_number(1),
            default=1,
            help="sequences (or images) per step and rank (default 1)",
        )
        parser.add_argument(
            "--seq-len",
            metavar="N",
            type=whole_number(1),
            help="tokens per sequence (default: the model's longest, from its config)",
        )
        parser.add_argument(
            "--gpu",
            default=None,
            help=f"the GPU modelled: {', '.join(GPUS)} or a compute capability such as sm90 "
            "(default: H100, or this machine's GPU)",
        )
        parser.add_argument(
            "--dtype",
            choices=list(_DTYPES),
            default="float32",
            help="the parameters' dtype (default float32)",
        )
        parser.add_argument(
            "--autocast", choices=list(_AUTOCAST), help="run the forward under CUDA autocast to this dtype"
        )
        parser.add_argument(
            "--optimizer",
            choices=["adamw", "adam", "sgd"],
            default="adamw",
            help="AdamW, Adam (lr 1e-4) or SGD with momentum 0.9; foreach kernels as PyTorch picks "
            "them on CUDA (default adamw)",
        )
        parser.add_argument(
            "--gradient-checkpointing",
            action="store_true",
            help="recompute activations in backward (the model's own switch)",
        )
        parser.add_argument(
            "--world-size",
            metavar="N",
            type=whole_number(1),
            default=1,
            help="ranks of the job, with --fsdp or --ddp; the estimate is one rank's (default 1)",
        )
        parallel = parser.add_mutually_exclusive_group()
        parallel.add_argument(
            "--fsdp", action="store_true", help="FSDP2: fully_shard on each repeated block, then on the model"
        )
        parallel.add_argument("--ddp", action="store_true", help="DistributedDataParallel")
        parser.add_argument(
            "--steps",
            metavar="N",
            type=whole_number(1),
            default=1,
            help="training steps in a row; 2 shows the steady state (default 1)",
        )
        parser.add_argument(
            "--budget",
            metavar="SIZE",
            help="the memory the step may use, such as '40 GiB' or '80GB' (default: the GPU's memory less "
            "512 MiB for the CUDA context)",
        )
        parser.add_argument(
            "--max-batch-size",
            action="store_true",
            help="also search the largest batch size whose steps fit on the GPU",
        )
        parser.add_argument(
            "--plan",
            action="store_true",
            help="also plan the cheapest change for the steps to fit the budget: the optimizer's foreach "
            "off, the fewest blocks to checkpoint (selectively, then whole), else micro-batches "
            "(memlab.plan)",
        )
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object (bytes) instead of text"
        )

    def run(self, args: argparse.Namespace) -> int:
        try:
            gpu = resolve_gpu(args.gpu, name="--gpu")
        except (TypeError, ValueError) as error:
            raise CommandError(str(error)) from None
        if args.world_size > 1 and not (args.fsdp or args.ddp):
            raise CommandError(
                f"--world-size {args.world_size} needs --fsdp or --ddp (how the ranks share the model)"
            )
        try:
            budget = _budget(args.budget, gpu)
        except ValueError as error:
            raise CommandError(str(error)) from None
        for flag, asked in (("--max-batch-size", args.max_batch_size), (self.plan_word, args.plan)):
            if asked and budget is None:
                raise CommandError(
                    f"{flag} needs a budget: --gpu {args.gpu} gives only a compute capability; "
                    f"name a GPU ({', '.join(GPUS)}) or pass --budget"
                )
        if args.plan and args.gradient_checkpointing:
            raise CommandError(
                f"{self.plan_word} chooses the blocks to checkpoint: leave out --gradient-checkpointing "
                "(it checkpoints them all)"
            )
        from memlab.integrations.models import model_recipe
        from memlab.integrations.training import (
            TrainingSetup,
            estimate_training,
            largest_batch,
            plan_training,
        )

        try:
            recipe = model_recipe(args.model)
        except ValueError as error:
            raise CommandError(str(error)) from None
        seq_len = args.seq_len if args.seq_len is not None else recipe.max_length
        if recipe.inputs == "tokens" and seq_len is None:
            raise CommandError(f"{args.model}: its config gives no longest sequence; pass --seq-len")
        if recipe.max_length is not None and seq_len > recipe.max_length:
            raise CommandError(
                f"--seq-len {seq_len}: the model takes at most {recipe.max_length} tokens (its config)"
            )
        setup = TrainingSetup(
            batch_size=args.batch_size,
            seq_len=seq_len,
            dtype=_DTYPES[args.dtype],
            autocast=_AUTOCAST.get(args.autocast),
            optimizer=args.optimizer,
            gradient_checkpointing=args.gradient_checkpointing,
            world_size=args.world_size,
            parallel="fsdp" if args.fsdp else "ddp" if args.ddp else None,
            steps=args.steps,
            gpu=gpu,
        )
        try:
            with Progress("estimate") as shown:  # on a terminal only (memlab._progress)
                shown.update(f"estimating {setup.steps} step(s) of {recipe.name}")
                estimate, counted = estimate_training(recipe, setup)
                shown.done(f"peak reserved {format_size(estimate.peak_reserved)}")
            fit = largest_batch(recipe, setup, budget) if args.max_batch_size else None
            found = None
            if args.plan:
                with Progress("estimate --plan") as shown:
                    shown.update(f"planning {recipe.name}'s steps to fit {format_size(budget)}")
                    found = plan_training(recipe, setup, budget)
                    shown.done("fits" if found.fits else "does not fit")
        except ValueError as error:  # a model that cannot train as asked (no checkpointing switch)
            raise CommandError(str(error)) from None
        answer = _answer(args, recipe, setup, estimate, counted, budget, fit)
        if found is not None:
            answer["plan"] = _plan(found, setup.batch_size)
        sys.stdout.write(json.dumps(answer) + "\n" if args.json else _text(answer))
        sys.stdout.flush()
        return 0


def _budget(text: str | None, gpu: GPU) -> int | None:
    """``--budget`` in bytes; without it the GPU's memory less the CUDA context's allowance
    (``None`` for a GPU known only by its compute capability)."""
    if text is not None:
        return parse_size(text, name="--budget")
    return gpu.default_budget() if gpu.total_memory is not None else None


def _answer(
    args: Any, recipe: Any, setup: Any, estimate: Any, counted: Any, budget: int | None, fit: Any
) -> dict[str, Any]:
    """Everything printed, as the JSON object (bytes)."""
    from memlab.integrations.formulas import closed_forms, why_they_differ

    by_category = estimate.by_category("peak")
    forms = closed_forms(
        counted.total, counted.largest_layer, setup.dtype, setup.optimizer, setup.world_size, setup.parallel
    )
    foreach = "optimizer_foreach" in estimate.substituted or torch.cuda.is_available()
    answer: dict[str, Any] = {
        "model": args.model,
        "model_class": counted.model_class,
        "task": recipe.task,
        "parameters": counted.total,
        "gpu": setup.gpu.name,
        "batch_size": setup.batch_size,
        "seq_len": setup.seq_len if recipe.inputs == "tokens" else None,
        "dtype": args.dtype,
        "autocast": args.autocast,
        "optimizer": setup.optimizer,
        "gradient_checkpointing": setup.gradient_checkpointing,
        "world_size": setup.world_size,
        "parallel": setup.parallel,
        "steps": setup.steps,
        "peak_allocated": estimate.peak_allocated,
        "peak_reserved": estimate.peak_reserved,
        "by_category": by_category,
        "budget": budget,
        "budget_given": args.budget is not None,
        "fits": None if budget is None else estimate.fits(budget),
        "formulas": {form.key: form.bytes for form in forms},
        "formula_labels": {form.key: form.label for form in forms},
        "why_they_differ": why_they_differ(
            by_category, estimate.peak_allocated, estimate.peak_reserved, foreach, setup.parallel == "fsdp"
        ),
        "workspaces": _workspaces(estimate.workspaces),
        "method": estimate.method,
        "caveats": list(estimate.caveats),
    }
    if fit is not None:
        answer["max_batch_size"] = fit.batch_size
        answer["max_batch_size_estimates"] = fit.estimates
        answer["next_batch_size_needs"] = (
            None if fit.next_estimate is None else fit.next_estimate.peak_reserved
        )
    return answer


def _plan(found: Any, batch_size: int) -> dict[str, Any]:
    """A :class:`memlab.plan.Plan` as the JSON object's ``plan`` (bytes, FLOPs of one step); its
    ``trainer``: the micro-batches of a batch of ``batch_size`` as a trainer's settings (``None``
    without micro-batches)."""
    trainer = None
    if found.micro_batches > 1:
        size = batch_size // found.micro_batches
        trainer = (
            f"as a trainer's settings: batches of {size}, {found.micro_batches} gradient accumulation steps "
            f"(Hugging Face: per_device_train_batch_size={size}, gradient_accumulation_steps="
            f"{found.micro_batches}; Lightning: a DataLoader of batch_size={size}, "
            f"accumulate_grad_batches={found.micro_batches})"
        )
    return {
        "fits": found.fits,
        "blocks": len(found.blocks),
        "checkpointed": found.checkpointed,
        "optimizer_foreach_off": found.settings.per_parameter,
        "micro_batches": found.micro_batches,
        "peak_reserved": found.estimate.peak_reserved,
        "recomputed_flops": found.recomputed_flops,
        "extra_compute": found.extra_compute,
        "tried": [
            *(
                {"optimizer_foreach_off": True, "fits": fits, "peak_reserved": peak}
                for _, fits, peak in found.setting_tries
            ),
            *(
                {"checkpointed": count, "fits": fits, "peak_reserved": peak}
                for count, fits, peak in found.tried
            ),
            *(
                {"micro_batches": count, "fits": fits, "peak_reserved": peak}
                for count, fits, peak in found.micro_batch_tries
            ),
            *(
                {
                    "checkpointed": count,
                    "micro_batches": found.micro_batches,
                    "fits": fits,
                    "peak_reserved": peak,
                }
                for count, fits, peak in found.combined_tries
            ),
        ],
        "rejected": found.rejected,
        "estimated": found.estimated,
        "trainer": trainer,
        "text": repr(found),
        "code": found.code,
    }


def _workspaces(found: Any) -> dict[str, Any] | None:
    """The modelled cuBLAS workspaces of the answer (count, bytes, GPU and the sentence the text's
    first line ends with), or ``None`` where none was modelled."""
    from memlab.sources.workspace_note import workspaces_note

    if found is None:
        return None
    return {"count": found.count, "bytes": found.nbytes, "gpu": found.gpu, "note": workspaces_note(found)}


def _count_text(count: int) -> str:
    """A parameter count as people write it: 8.03B, 124.4M, 167.7K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.4g}{suffix}"
    return str(count)


def _text(answer: dict[str, Any]) -> str:
    steps = "one step" if answer["steps"] == 1 else f"{answer['steps']} steps in a row"
    shape = f"batch {answer['batch_size']}" + (f" x {answer['seq_len']} tokens" if answer["seq_len"] else "")
    precision = answer["dtype"] + (f", {answer['autocast']} autocast" if answer["autocast"] else "")
    job = ""
    if answer["parallel"]:
        job = f", rank 0 of {answer['world_size']} ({answer['parallel'].upper()})"
    lines = [
        f"memlab estimate: {answer['model']} ({answer['model_class']}, {_count_text(answer['parameters'])} "
        "parameters)" + (f"; {answer['workspaces']['note']}" if answer["workspaces"] else ""),
        f"{steps} of {answer['optimizer']}, {shape}, {precision}"
        + (", gradient checkpointing" if answer["gradient_checkpointing"] else "")
        + f", on {answer['gpu']}{job}",
        f"peak allocated {format_size(answer['peak_allocated'])}, "
        f"reserved {format_size(answer['peak_reserved'])}",
    ]
    if answer["budget"] is None:
        lines.append(f"fits: unknown ({answer['gpu']} has no known memory size; pass --budget)")
    else:
        verdict = "fits" if answer["fits"] else "does NOT fit"
        whose = "--budget" if answer["budget_given"] else "its memory less 512 MiB for the CUDA context"
        lines.append(f"{verdict} on {answer['gpu']} ({format_size(answer['budget'])} usable: {whose})")
    lines.append("at the peak of allocated bytes:")
    by_category = answer["by_category"]
    for key, name in _SHOWN.items():
        lines.append(f"  {name:<18}{format_size(by_category[key]):>10}")
    other = sum(v for k, v in by_category.items() if k not in _SHOWN)
    lines.append(f"  {'other':<18}{format_size(other):>10}  (inputs, buffers, unknown)")
    lines.append("closed-form numbers (model states only):")
    for key, value in answer["formulas"].items():
        lines.append(f"  {format_size(value):>10}  {answer['formula_labels'][key]}")
    lines.append(f"why they differ: {answer['why_they_differ']}")
    if "max_batch_size" in answer:
        needs = answer["next_batch_size_needs"]
        after = (
            "" if needs is None else f"; {answer['max_batch_size'] + 1} needs {format_size(needs)} reserved"
        )
        lines.append(
            f"largest batch that fits: {answer['max_batch_size']}{after} "
            f"({answer['max_batch_size_estimates']} estimates)"
        )
    if "plan" in answer:
        lines += answer["plan"]["text"].splitlines() + answer["plan"]["code"].splitlines()
        lines += [answer["plan"]["trainer"]] if answer["plan"]["trainer"] else []
    lines += [f"caveat: {caveat}" for caveat in answer["caveats"]]
    return "\n".join(lines) + "\n"


class PlanCommand(EstimateCommand):
    """``memlab plan CONFIG_OR_MODEL [options of memlab estimate]``: ``memlab estimate --plan``."""

    help = "plan the cheapest change that makes a model's training steps fit a GPU (memlab estimate --plan)"
    plan_word = "a plan"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        super().prepare_parser(parser)
        parser.description = (
            "memlab estimate CONFIG_OR_MODEL --plan: the estimate of the training steps of a model built "
            "from its config, then the cheapest change that makes them fit the budget (the optimizer's "
            "foreach off, the fewest blocks to checkpoint, selectively then whole, else micro-batches), "
            "searched with estimates "
            "as memlab.plan searches, with the code to paste and the trainer settings."
        )
        parser.set_defaults(plan=True)
