"""Misuse a metric can see in its caller, reported where it happens with the remedy.

- torchmetrics wrappers that need ``compute()`` to be one tensor (``BootStrapper``,
  ``MinMaxMetric``, ``MultioutputWrapper``, ``MetricTracker.best_metric``) or a
  per-class tensor (``ClasswiseWrapper``) fail with obscure errors (or, for
  ``ClasswiseWrapper`` and a dict, silently name the dict's keys as values). ``compute()``
  looks up the call stack for their methods (a comparison of code objects per frame,
  no frame locals read) and raises a ``ValueError`` that says what works; so does
  ``higher_is_better``, which ``MetricTracker(metric)`` reads when it is built (a
  result that torchmetrics cached is returned without ``compute()``).
- Lightning's ``self.log(name, metric)`` reads ``metric._forward_cache`` when it is
  called and needs ``compute()`` to be one tensor only at epoch end, where it fails with
  "must be a tensor". A metric whose ``compute()`` is a dict raises at that first read
  instead, naming ``per_k()``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import CodeType, FrameType
from typing import Any

_MAX_DEPTH = 40  # frames looked at above compute(); a wrapper calls it within a few
_codes: dict[CodeType, str] | None = None


def _wrapper_codes() -> dict[CodeType, str]:
    """The code objects of the wrapper methods that cannot take our output, by name."""
    global _codes
    if _codes is None:
        from torchmetrics import wrappers

        found: dict[CodeType, str] = {}
        for cls, methods in (
            ("ClasswiseWrapper", ("compute", "forward")),
            ("BootStrapper", ("compute", "forward")),
            ("MinMaxMetric", ("compute", "forward")),
            ("MultioutputWrapper", ("compute", "forward")),
            ("MetricTracker", ("best_metric", "__init__")),
        ):
            wrapper = getattr(wrappers, cls, None)
            for method in methods:
                function = getattr(wrapper, method, None)
                code = getattr(function, "__code__", None)
                if isinstance(code, CodeType):
                    found[code] = f"{cls}.{method}"
        _codes = found
    return _codes


def _find_wrapper(frame: FrameType | None) -> tuple[str, FrameType] | None:
    codes = _wrapper_codes()
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        name = codes.get(frame.f_code)
        if name is not None:
            return name, frame
        frame = frame.f_back
    return None


def check_wrapper_caller(metric: Any) -> None:
    """Raise if a torchmetrics wrapper that cannot use this metric's output computes it.

    ``metric`` has ``output_keys``, ``_returns_dict`` (whether ``compute()`` returns a
    dict) and ``_items_are_samples`` (whether its rows are samples that also make up
    the gallery, which ``BootStrapper`` would copy).
    """
    found = _find_wrapper(sys._getframe(2))
    if found is None:
        return
    method, frame = found
    wrapper = method.split(".")[0]
    name = type(metric).__name__
    keys: Sequence[str] = metric.output_keys
    if wrapper == "BootStrapper" and metric._items_are_samples:
        raise ValueError(
            f"BootStrapper resamples the rows of each update, and {name}'s rows are"
            " samples that also form the gallery: a sample drawn twice finds its own copy,"
            " a guaranteed hit, so every resampled value is inflated. Use"
            " confidence_interval() for an interval of every K without resampling"
        )
    if wrapper == "ClasswiseWrapper":
        raise ValueError(
            f"ClasswiseWrapper names the entries of a per-class tensor, and {name} has no"
            " classes: its values are one per K. Use it unwrapped: compute() returns"
            " a dict named by `key=` (default 'recall@{k}'), and per_k(prefix) gives one"
            " Metric per K for Lightning"
        )
    if not metric._returns_dict:
        return
    several = f"this {name} returns {len(keys)} values ({', '.join(keys)})"
    if wrapper == "MetricTracker":
        from torchmetrics import Metric

        tracker = frame.f_locals.get("self", None)
        tracked = frame.f_locals.get("metric", None) if method.endswith("__init__") else None
        if isinstance(tracked, Metric) or isinstance(
            getattr(tracker, "_base_metric", None), Metric
        ):
            raise ValueError(
                f"MetricTracker.best_metric() needs one tensor per step, and {several}:"
                " track it in a MetricCollection with maximize=True,"
                " MetricTracker(MetricCollection({'recall': metric}), maximize=True),"
                " or track one metric per K with an int `k`"
            )
        if tracked is not None or isinstance(getattr(tracker, "maximize", None), list):
            raise ValueError(
                "MetricTracker.best_metric() takes one `maximize` entry per member of the"
                f" MetricCollection, and {several}: pass maximize=True (every Recall@K is"
                " better higher)"
            )
        return
    remedy = "give the wrapper one metric per K, with an int `k` (k=5)"
    if wrapper == "BootStrapper":
        remedy += ", or use confidence_interval() for an interval of every K without resampling"
    raise ValueError(
        f"{wrapper} needs a metric whose compute() is one tensor, and {several}: {remedy}"
    )


def _lightning_log_name(frame: FrameType | None) -> str | None:
    """The logged name when ``frame`` is Lightning's logging reading a metric, else None."""
    if frame is None:
        return None
    module = str(frame.f_globals.get("__name__", ""))
    if not module.endswith("logger_connector.result"):
        return None
    owner = frame.f_locals.get("self", None)
    name = getattr(getattr(owner, "meta", None), "name", None)
    return str(name) if name is not None else "..."


def check_lightning_log(name: str, keys: Sequence[str]) -> None:
    """Raise when Lightning's ``self.log`` reads a metric whose ``compute()`` is a dict."""
    logged = _lightning_log_name(sys._getframe(2))
    if logged is None:
        return
    prefix = logged.rpartition("/")[0] + "/" if "/" in logged else ""
    raise ValueError(
        f"self.log({logged!r}, metric): this {name}'s compute() is a dict of {len(keys)}"
        f" values ({', '.join(keys)}), and Lightning logs a Metric only when its compute()"
        " is one tensor (it would fail at epoch end). Log `metric.per_k(prefix)`, one"
        f" Metric per value: self.log_dict(metric.per_k({prefix!r})); in a"
        " MetricCollection, log the other members and this one's per_k(); or use an int `k`"
    )


class HigherIsBetter:
    """``higher_is_better``: True. Read on an instance (as ``MetricTracker(metric)``
    does when it is built, to choose its ``maximize``), it first checks the caller as
    ``compute()`` does."""

    def __get__(self, metric: Any, owner: Any = None) -> bool:
        if metric is not None:
            check_wrapper_caller(metric)
        return True
