"""Models nobody has downloaded: a training step built from a Hugging Face ``config.json`` (or a
``torchvision`` / ``timm`` model name), data-free, for ``memlab estimate``.

:func:`model_recipe` reads what names the model (a config, nothing else: no weights, no network)
and returns a :class:`ModelRecipe`, whose :meth:`~ModelRecipe.build` makes the model and
:meth:`~ModelRecipe.batch` a batch of its inputs. Both are meant to run under the estimate's own
``FakeTensorMode`` (:func:`memlab.estimate.estimate.run_estimate` calls its ``make_arguments``
under it): every tensor they create is then fake from the start, so a 70B model builds in host
memory of a few hundred MiB, and the estimate's copier takes those tensors as they are (a fake
tensor of its own mode is data-free already).

Why not the ``meta`` device (``with torch.device("meta")``, accelerate's ``init_empty_weights``): a
Hugging Face Llama's rotary embedding enters ``torch.autocast(device_type=x.device.type,
enabled=False)`` itself, which on ``meta`` tensors is ``torch.autocast("meta")``, and PyTorch 2.13
raises ``unsupported scalarType`` there, with or without the user's own autocast. Fake tensors
made under the estimate's mode stand for CPU tensors, so that region is a CPU autocast region,
``torch.autocast("cuda")`` in the step is modelled by :mod:`memlab.estimate.autocast` and CUDA's
kernel choices by :mod:`memlab.estimate.kernels`, as for any user's step. Weight initialisation is
skipped (Hugging Face's ``no_init_weights``: ``torch.nn.init`` made a no-op, ``_init_weights``
off), since an initialiser on a fake tensor only costs time: ``torch.empty`` alone decides the
memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TASKS", "ModelRecipe", "model_recipe"]

#: The training tasks a config can be built for, in the order tried: the Auto class's name and
#: how its batch is made (``tokens``: ``input_ids`` and ``labels`` of batch x sequence;
#: ``images``: ``pixel_values`` and one label per image).
TASKS = (
    ("causal-lm", "AutoModelForCausalLM", "tokens"),
    ("masked-lm", "AutoModelForMaskedLM", "tokens"),
    ("seq2seq-lm", "AutoModelForSeq2SeqLM", "tokens"),
    ("image-classification", "AutoModelForImageClassification", "images"),
)
_VISION_NAME = "a torchvision or timm model name (torchvision.models.get_model, timm.create_model)"


@dataclass
class ModelRecipe:
    """How to build a model and its batches without data.

    ``name``: what the user named (a path or a model name). ``library``: ``"transformers"``,
    ``"torchvision"`` or ``"timm"``. ``task``: one of :data:`TASKS`' names (``"image-classification"``
    for torchvision and timm). ``inputs``: ``"tokens"`` or ``"images"``. ``max_length``: the longest
    sequence the model takes (``None`` for images). ``layer_classes``: the class names of the
    model's repeated blocks (Hugging Face's ``_no_split_modules``: ``LlamaDecoderLayer``), which
    FSDP2 shards one by one; empty when the library does not name them (``memlab estimate --fsdp``
    then shards the entries of the model's ``ModuleList``s).
    """

    name: str
    library: str
    task: str
    inputs: str
    max_length: int | None
    vocab_size: int | None
    image_shape: tuple[int, int, int] | None
    num_labels: int
    _build: Callable[[torch.dtype], torch.nn.Module]
    layer_classes: tuple[str, ...] = ()

    def build(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """A new model with parameters of ``dtype``, its weights not initialised (their values are
        whatever ``torch.empty`` holds: under a fake mode, nothing at all), in training mode."""
        model = self._build(dtype)
        return model.train()

    def batch(self, batch_size: int, seq_len: int | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The keyword arguments of one training batch: ``input_ids`` and ``labels`` (int64,
        ``batch_size x seq_len``, random tokens) for a language model; ``pixel_values``
        (``dtype``, ``batch_size x C x H x W``) and ``labels`` (one class each) for an image model
        (``seq_len`` ignored)."""
        if self.inputs == "tokens":
            tokens = torch.randint(0, self.vocab_size or 2, (batch_size, seq_len or 1))
            return {"input_ids": tokens, "labels": tokens}
        images = torch.randn(batch_size, *(self.image_shape or (3, 224, 224)), dtype=dtype)
        key = "pixel_values" if self.library == "transformers" else "images"
        return {key: images, "labels": torch.randint(0, self.num_labels, (batch_size,))}

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the library's warnings are off (Hugging Face's deprecations and
        one-time notes, printed on the first forward)."""
        return _quiet_transformers() if self.library == "transformers" else contextlib.nullcontext()

    def enable_checkpointing(self, model: torch.nn.Module) -> None:
        """Turn on the library's own activation checkpointing: Hugging Face's
        ``gradient_checkpointing_enable`` (non-reentrant, KV cache off), timm's
        ``set_grad_checkpointing``. ``ValueError`` where the model has none."""
        if self.library == "transformers":
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"{self.name}: {type(model).__name__} does not support gradient checkpointing"
                )
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.library == "timm" and hasattr(model, "set_grad_checkpointing"):
            model.set_grad_checkpointing(True)
        else:
            raise ValueError(f"{self.name}: {self.library} models have no gradient checkpointing switch")


def model_recipe(source: str) -> ModelRecipe:
    """The :class:`ModelRecipe` for ``source``: a folder holding a Hugging Face ``config.json``,
    such a file itself, or a ``torchvision`` / ``timm`` model name (when that library is
    installed). Reads only the config: no weights, no network (``local_files_only``).

    ``ValueError`` (its message names what was wrong and what is valid) for a path that does not
    exist, a folder without ``config.json``, a file that is not JSON or has no ``model_type``, a
    model type this ``transformers`` does not know or that no training task of :data:`TASKS`
    takes, and a name that is not a path when neither torchvision nor timm is installed."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"name a model: a config.json, a folder holding one, or {_VISION_NAME}")
    if os.path.exists(source) or os.sep in source or source.endswith(".json"):
        return _transformers_recipe(source)
    return _vision_recipe(source)


# -- Hugging Face --------------------------------------------------------------------------------
def _config_file(source: str) -> str:
    if not os.path.exists(source):
        raise ValueError(
            f"{source}: no such file or folder; name a config.json, a folder holding one, or {_VISION_NAME}"
        )
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise ValueError(f"{source}: the folder holds no config.json (a Hugging Face model folder has one)")
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON model config ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(
            f'{path}: not a Hugging Face model config: it has no "model_type" '
            '(such as "llama", "gpt2", "bert", "vit")'
        )
    return path


def _transformers_recipe(source: str) -> ModelRecipe:
    path = _config_file(source)
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"{path}: building a model from a config needs transformers (pip install transformers)"
        ) from None

    with _quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError, OSError) as error:
            first = str(error).split(". ")[0].splitlines()[0]
            raise ValueError(
                f"{path}: transformers {transformers.__version__} cannot read it: {first}"
            ) from None
    found = _model_class(transformers, config)
    if found is None:
        tasks = ", ".join(task for task, _, _ in TASKS)
        raise ValueError(
            f"{path}: a {config.model_type} config, which none of the training tasks memlab builds "
            f"takes ({tasks})"
        )
    task, inputs, model_class = found

    def build(dtype: torch.dtype) -> torch.nn.Module:
        from transformers.modeling_utils import no_init_weights

        with _quiet_transformers(), no_init_weights():
            model = model_class._from_config(config, dtype=dtype)
        model.tie_weights()  # skipped with the initialisation; from_pretrained ties them after loading
        return model

    image_size = getattr(config, "image_size", 224)
    side = image_size if isinstance(image_size, int) else image_size[0]
    return ModelRecipe(
        name=source,
        library="transformers",
        task=task,
        inputs=inputs,
        max_length=_max_length(config) if inputs == "tokens" else None,
        vocab_size=getattr(config, "vocab_size", None),
        image_shape=(getattr(config, "num_channels", 3), side, side) if inputs == "images" else None,
        num_labels=getattr(config, "num_labels", 2),
        _build=build,
        layer_classes=tuple(getattr(model_class, "_no_split_modules", None) or ()),
    )


def _model_class(transformers: Any, config: Any) -> tuple[str, str, type] | None:
    """``(task, inputs, model class)`` for ``config``: the class its ``architectures`` names where a
    task of :data:`TASKS` builds it (``BertForMaskedLM``), else the first task that takes the config."""
    candidates = []
    for task, auto_name, inputs in TASKS:
        mapping = getattr(transformers, auto_name)._model_mapping
        if type(config) in mapping:
            candidates.append((task, inputs, mapping[type(config)]))
    named = set(getattr(config, "architectures", None) or ())
    for candidate in candidates:
        if candidate[2].__name__ in named:
            return candidate
    return candidates[0] if candidates else None


def _max_length(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hugging Face's warnings (deprecations, "you should train this model") off for the block."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


# -- torchvision and timm ------------------------------------------------------------------------
def _vision_recipe(name: str) -> ModelRecipe:
    found = [library for library in ("torchvision", "timm") if importlib.util.find_spec(library) is not None]
    if not found:
        raise ValueError(
            f"{name}: no such file or folder, and it cannot be {_VISION_NAME}: neither is installed "
            f"(pip install torchvision, or pip install timm); or name a config.json or a folder holding one"
        )
    for library in found:
        build = _torchvision_builder(name) if library == "torchvision" else _timm_builder(name)
        if build is not None:
            return ModelRecipe(
                name=name,
                library=library,
                task="image-classification",
                inputs="images",
                max_length=None,
                vocab_size=None,
                image_shape=(3, 224, 224),
                num_labels=1000,
                _build=build,
            )
    raise ValueError(f"{name}: no such file or folder, and not a model name {' or '.join(found)} knows")


def _torchvision_builder(name: str) -> Callable[[torch.dtype], torch.nn.Module] | None:
    import torchvision

    if name not in torchvision.models.list_models():
        return None
    return lambda dtype: torchvision.models.get_model(name, weights=None).to(dtype)


def _timm_builder(name: str) -> Callable[[torch.dtype], torch.nn.Module] | None:
    import timm

    if not timm.is_model(name):
        return None
    return lambda dtype: timm.create_model(name, pretrained=False).to(dtype)
