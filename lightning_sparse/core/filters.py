"""Which parameters get sparsified: the default filter and glob / regex / callable filters.

A filter is a callable ``(name, param) -> bool`` over the full dotted parameter name. The default
follows Cerebras' ``default_sparse_param_filter`` and also decides by module type, so models that
name things differently (Hugging Face ``embed_tokens`` / ``lm_head``, tied embeddings) come out
right: weights with ``ndim >= 2`` that are not embeddings, normalisation or an output head, and
never the adapters PEFT adds (:func:`adapter_parameter_ids`: LoRA A/B, DoRA magnitudes,
``modules_to_save`` copies, other tuners' parameters).

Output heads are found by structure where possible (:func:`output_head_ids`: the module a Hugging
Face model's ``get_output_embeddings()`` returns; its last projection when that projects to
``config.num_labels``) and by name: a module named ``lm_head``, ``output_layer``, ``output`` or
``head``, or one inside a module named ``classifier``, ``score``, ``qa_outputs`` or ``pooler``
(the Hugging Face sequence-classification, token-classification and question-answering heads,
and BERT's pooler, which feeds only the classifier).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch import nn

from .layouts import is_hf_conv1d

__all__ = [
    "ParamFilter",
    "adapter_parameter_ids",
    "dense_by_default_ids",
    "frozen_left_dense",
    "PatternFilter",
    "default_sparse_param_filter",
    "glob_filter",
    "make_param_filter",
    "output_head_ids",
    "regex_filter",
    "unselected_patterns",
]

ParamFilter = Callable[[str, torch.Tensor], bool]

_DENSE_NAME_PARTS = ("embed", "norm", "lm_head", "pe_helper")
_HEAD_LEAF_NAMES = ("lm_head", "output_layer", "output", "head")
_HEAD_PATH_NAMES = ("classifier", "score", "qa_outputs", "pooler")


def default_sparse_param_filter(name: str, param: torch.Tensor | None) -> bool:
    """Cerebras' default, by name: ``ndim > 1`` and no embedding / norm / LM-head in the name.

    Args:
        name: full dotted parameter name.
        param: the parameter (``None`` is never sparsified).
    """
    if param is None or param.ndim < 2:
        return False
    lowered = name.lower()
    return not any(part in lowered for part in _DENSE_NAME_PARTS)


def is_dense_by_module(
    module: nn.Module, module_name: str, tied_ids: set[int], p: torch.Tensor
) -> bool:
    """Module-type half of the default filter: embeddings, norms, the output head, tied weights.

    Args:
        module: the module owning the parameter.
        module_name: its full dotted name.
        tied_ids: ``id``s of parameters that appear under more than one name (tied weights).
        p: the parameter.
    """
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return True
    if "norm" in type(module).__name__.lower():
        return True
    parts = module_name.lower().split(".")
    if parts[-1] in _HEAD_LEAF_NAMES or any(part in _HEAD_PATH_NAMES for part in parts):
        return True
    return id(p) in tied_ids


def output_head_ids(root: nn.Module) -> set[int]:
    """``id``s of the output-head parameters of every Hugging Face model in ``root``.

    For each submodule (``root`` included) with a ``get_output_embeddings`` method (Hugging Face
    ``PreTrainedModel``): the parameters of the module it returns (``lm_head``), and those of its
    last ``nn.Linear`` / ``Conv1D`` when that projects to ``config.num_labels`` outputs (the
    ``classifier`` / ``score`` / ``qa_outputs`` of ``*ForSequenceClassification`` and kin).
    Models without these (plain ``nn.Module``) contribute nothing. The default filter keeps these
    dense; add them to ``tied_ids`` of :func:`is_dense_by_module`.
    """
    ids: set[int] = set()
    for module in root.modules():
        get_head = getattr(module, "get_output_embeddings", None)
        if not callable(get_head):
            continue
        try:
            head = get_head()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            ids.update(id(p) for p in head.parameters())
        num_labels = getattr(getattr(module, "config", None), "num_labels", None)
        projections = [m for m in module.modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m)]
        if projections and num_labels is not None:
            last = projections[-1]
            weight = last.weight  # a Linear's or Conv1D's: a Tensor
            if not isinstance(weight, torch.Tensor):
                continue
            if weight.shape[1 if is_hf_conv1d(last) else 0] == num_labels:
                ids.update(id(p) for p in last.parameters())
    return ids


def adapter_parameter_ids(root: nn.Module) -> set[int]:
    """``id``s of the parameters PEFT adds to ``root``: never selected by the default filter.

    PEFT (``get_peft_model``) wraps layers in tuner layers (`peft.tuners.tuners_utils.
    BaseTunerLayer`: LoRA, DoRA, AdaLoRA, LoHa, LoKr, IA3, OFT, VeRA, ...) that list their adapter
    parameters' attributes in ``adapter_layer_names`` (LoRA: ``lora_A``, ``lora_B``,
    ``lora_embedding_A``, ``lora_embedding_B``; DoRA adds ``lora_magnitude_vector``) and
    ``other_param_names``, and wraps ``modules_to_save`` in an ``AuxiliaryTrainingWrapper`` whose
    trainable copies sit under ``modules_to_save``; prompt-learning models keep theirs under
    ``prompt_encoder``. All of these are adapters; the base weights (``base_layer``,
    ``original_module``) are not. Found by class (peft's own base classes, by name, so nothing
    imports peft: a model can only hold peft modules once peft is imported).
    """
    if "peft" not in sys.modules:
        return set()
    ids: set[int] = set()
    for module in root.modules():
        if _is_peft_layer(module):
            attrs: Iterable[str] = (
                vars(module).get("adapter_layer_names")
                or getattr(type(module), "adapter_layer_names", None)
                or ()
            )
            other: Iterable[str] = getattr(type(module), "other_param_names", ())
            for attr in (*attrs, *other):
                ids.update(id(p) for p in _parameters_under(module, attr))
        prompt = module._modules.get("prompt_encoder")
        if prompt is not None and type(module).__module__.startswith("peft."):
            ids.update(id(p) for p in prompt.parameters())
    return ids


_PEFT_BASES = ("BaseTunerLayer", "AuxiliaryTrainingWrapper")


def _is_peft_layer(module: nn.Module) -> bool:
    return any(
        cls.__name__ in _PEFT_BASES and cls.__module__.startswith("peft.")
        for cls in type(module).__mro__
    )


def _parameters_under(module: nn.Module, attr: str) -> list[nn.Parameter]:
    """The parameter ``module.<attr>``, or those of the submodule there (read from the registries,
    not ``getattr``: peft's wrappers forward unknown attributes to the wrapped module)."""
    param = module._parameters.get(attr)
    if param is not None:
        return [param]
    sub = module._modules.get(attr)
    return list(sub.parameters()) if sub is not None else []


def dense_by_default_ids(root: nn.Module) -> set[int]:
    """``id``s the default filter never selects: output heads (`output_head_ids`) and PEFT
    adapters (`adapter_parameter_ids`)."""
    return output_head_ids(root) | adapter_parameter_ids(root)


def frozen_left_dense(owner: str, frozen: Sequence[str]) -> str:
    """The warning for parameters the default filter left dense because they are frozen: their
    names (the first three and a count) and how to select them (``*base_layer.weight`` for the
    base weights a PEFT model wraps)."""
    shown = ", ".join(repr(name) for name in frozen[:3])
    if len(frozen) > 3:
        shown += f" and {len(frozen) - 3} more"
    if any(".base_layer." in name for name in frozen):
        example = '"*base_layer.weight" (the base weights PEFT wraps)'
    else:
        example = f"{frozen[0]!r} or a glob matching them"
    return (
        f"{owner}: the default filter left {len(frozen)} frozen parameter(s) dense: {shown}; it "
        "sparsifies trainable weights only, and never PEFT adapters. To give frozen weights a "
        f"fixed mask, select them with param_filter, e.g. param_filter={example}"
    )


class PatternFilter:
    """A filter from name patterns, any-match; it can tell which of its patterns match nothing.

    Args:
        key: the argument the patterns came from (``param_filter``, ``param_name_patterns``),
            used in messages.
        kind: ``"glob"`` (fnmatch, full match, ``*`` also matches ``.``) or ``"regex"``
            (``re.search``).
        patterns: the patterns, in order.
    """

    def __init__(self, key: str, kind: str, patterns: list[str]) -> None:
        self.key, self.kind, self.patterns = key, kind, list(patterns)
        if kind == "glob":  # translate escapes every regex character the glob does not use
            self._tests = [re.compile(fnmatch.translate(p)).match for p in self.patterns]
        else:
            self._tests = [_compile_regex(p).search for p in self.patterns]
        self.__qualname__ = f"{kind}_filter({self.patterns!r})"  # what loggers show

    def __call__(self, name: str, param: torch.Tensor | None) -> bool:
        return any(test(name) for test in self._tests)

    def matches(self, pattern: str, names: Iterable[str]) -> list[str]:
        """The names ``pattern`` (one of `patterns`) matches, in order."""
        test = self._tests[self.patterns.index(pattern)]
        return [name for name in names if test(name)]

    def __repr__(self) -> str:
        return self.__qualname__


def glob_filter(patterns: str | Sequence[str]) -> PatternFilter:
    """Filter matching full names against fnmatch globs (``*`` also matches ``.``); any-match.

    Raises:
        TypeError: a pattern that is not a string, naming it.
    """
    patterns = _pattern_list("param_filter", patterns, "a glob such as 'fc*.weight'")
    return PatternFilter("param_filter", "glob", patterns)


def regex_filter(patterns: str | Sequence[str]) -> PatternFilter:
    """Filter for Cerebras 2.0/2.1 ``param_name_patterns``: ``re.search`` of any pattern.

    Raises:
        ValueError: a pattern that is not a Python regex, naming it, the regex error and the fix.
    """
    patterns = _pattern_list("param_name_patterns", patterns, "a regex such as '.*fc.*weight'")
    return PatternFilter("param_name_patterns", "regex", patterns)


def unselected_patterns(
    owner: str,
    param_filter: ParamFilter | None,
    names: Sequence[str],
    selected: Collection[str] | None = None,
    taken_by: Mapping[str, str] | None = None,
) -> list[str]:
    """One message per pattern of ``param_filter`` that selects no parameter.

    A pattern selects nothing when it matches none of ``names`` (the message names the closest
    parameter name, for a typo such as ``*v_prj.weight``), or when every name it matches is
    outside ``selected`` (in a `Group`: taken by an earlier member, named by ``taken_by``).
    Filters that are not a `PatternFilter` (callables, the default) give no message.

    Args:
        owner: who applies the filter, e.g. ``"sparsity_rigl_0"``.
        param_filter: the filter.
        names: every candidate parameter name of the model.
        selected: the names this filter's owner got (default: every name it matches).
        taken_by: ``{name: who got it}`` for the names others got.
    """
    if not isinstance(param_filter, PatternFilter):
        return []
    messages = []
    for pattern in param_filter.patterns:
        matched = param_filter.matches(pattern, names)
        what = f"{owner}: {param_filter.key} {param_filter.kind} {pattern!r}"
        if not matched:
            close = close_name(pattern, names)
            hint = f" (closest parameter name: {close!r})" if close else ""
            messages.append(
                f"{what} matches no parameter{hint}; check it against model.named_parameters()"
            )
        elif selected is not None and not set(matched) & set(selected):
            owners = sorted({(taken_by or {}).get(n, "another filter") for n in matched})
            messages.append(
                f"{what} selects nothing: the {len(matched)} parameter(s) it matches (first: "
                f"{matched[0]!r}) go to {', '.join(owners)}, listed earlier (the first matching "
                "filter wins); put this pattern first or narrow the earlier one"
            )
    return messages


def close_name(pattern: str, names: Iterable[str]) -> str | None:
    """The parameter name whose dotted tail is closest to ``pattern`` without its wildcards
    (``difflib``), or ``None`` when nothing is close."""
    literal = pattern.replace("*", "").replace("?", "").strip(".")
    tails: dict[str, str] = {}
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            tails.setdefault(".".join(parts[i:]), name)
    found = difflib.get_close_matches(literal, list(tails), n=1, cutoff=0.6)
    return tails[found[0]] if found else None


def _pattern_list(key: str, patterns: object, example: str) -> list[str]:
    """``patterns`` as a list of strings, or a TypeError naming ``key`` and the bad entry."""
    if isinstance(patterns, Iterable) and not isinstance(patterns, bytes):
        listed = [patterns] if isinstance(patterns, str) else list(patterns)
        bad = [p for p in listed if not isinstance(p, str)]
        if not bad:
            return listed
        raise TypeError(
            f"{key}={patterns!r} holds {bad[0]!r} ({type(bad[0]).__name__}); every pattern must "
            f"be a string, e.g. {example} (quote it in YAML)"
        )
    raise TypeError(f"{key}={patterns!r} must be {example} or a list of such strings")


def _compile_regex(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(
            f"param_name_patterns={pattern!r} is not a valid Python regex ({err.msg} at position "
            f"{err.pos}): param_name_patterns are Python regexes searched in the parameter name "
            "(use '.*' not '*', and '\\.' or '\\(' for a literal dot or bracket, e.g. "
            "'.*fc.*weight'); for globs such as '*.weight' use param_filter instead"
        ) from err


def make_param_filter(spec: str | Sequence[str] | ParamFilter | None) -> ParamFilter | None:
    """Turn a glob, a list of globs or a callable into a filter; ``None`` means the default.

    Raises:
        TypeError: for anything else, naming the value.
    """
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        return glob_filter(spec)
    if isinstance(spec, Sequence) and all(isinstance(s, str) for s in spec):
        return glob_filter(list(spec))
    raise TypeError(
        f"param_filter={spec!r} is not supported: use a glob string such as '*.weight', a list "
        "of globs, or a callable (name, param) -> bool"
    )
