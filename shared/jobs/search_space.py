"""A sweep's search space (``SweepCreate.search_space``) checked and turned into Optuna's terms:
each range's bounds as values of its hyperparameter, its size bounded before anything is built
from it, and a grid's points (``algorithm: grid``) counted from the ranges first.

Bounds, so that no request can make the API build something huge (issue 34):

- a stepped range (``int``, or ``float`` with a ``step``) holds at most ``MAX_RANGE_VALUES`` (2**53)
  values, and an ``int`` range's bounds lie within +-2**53: beyond that a float64 (Optuna's TPE,
  JSON readers) no longer tells neighbouring integers apart, and Optuna's own step arithmetic
  (``decimal``, 28 digits) fails;
- a grid has at most ``TUNEJOB_MAX_GRID_POINTS`` points (default 100,000), counted as the product of
  its ranges' sizes without listing them; Optuna's ``GridSampler`` lists every point when built
  (about 0.06 s and 10 MB per 100,000).
"""

import math
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import ValidationError

from shared.errors import UserError
from shared.jobs.base_models import available_models, hub_hint
from shared.jobs.planning import max_input_length
from shared.jobs.priors import PRIORS
from shared.schemas.hyperparameters import TASK_ONLY, Hyperparameters, int_fields
from shared.schemas.jobs import model_name
from shared.schemas.sweeps import Distribution, SweepCreate
from shared.settings import get_settings

BASE_MODEL = "base_model"  # searchable too (categorical): a job field, not a hyperparameter
SEARCHABLE = (BASE_MODEL, *(name for name in Hyperparameters.model_fields if name != "metric_for_best_model"))
MAX_RANGE_VALUES = 2**53


def refuse(message: str, param: str) -> UserError:
    return UserError("invalid_search_space", f"{param}: {message}", param)


def distributions(spec: SweepCreate) -> dict[str, BaseDistribution]:
    """The search space as Optuna distributions, each bound checked as a value of its hyperparameter.

    Raises:
        UserError: 422 ``invalid_search_space`` naming ``search_space.<name>`` (or its ``.low``,
            ``.high``, ``.step``, ``.choices``) and the value: an unknown hyperparameter, a float
            range over an integer one, a range over ``MAX_RANGE_VALUES``, a bound its
            hyperparameter refuses.
    """
    fixed = spec.hyperparameters.model_dump()
    out: dict[str, BaseDistribution] = {}
    for name, d in spec.search_space.items():
        field = f"search_space.{name}"
        if name not in SEARCHABLE:
            raise refuse(f"{name!r} is not a hyperparameter; use one of {', '.join(SEARCHABLE)}", field)
        if TASK_ONLY.get(name, spec.task) != spec.task:
            raise refuse(f"{name!r} applies to task {TASK_ONLY[name]!r} only, not {spec.task!r}", field)
        if d.type is None:
            raise refuse(
                f"a range needs its type (float, int or categorical) and bounds; tunejob fills them only "
                f"for {', '.join(PRIORS['base'])}, and only when no bound, step or choice is given",
                f"{field}.type",
            )
        if name == BASE_MODEL:
            if d.type != "categorical" or not d.choices or not all(isinstance(v, str) for v in d.choices):
                raise refuse("base_model is searched over categorical choices of model names", field)
            out[name] = CategoricalDistribution(d.choices)
            continue
        if d.type == "categorical":
            if not d.choices:
                raise refuse("a categorical range needs choices", f"{field}.choices")
            if any(v is not None and not isinstance(v, (bool, int, float, str)) for v in d.choices):
                raise refuse("choices must be numbers, strings, booleans or null", f"{field}.choices")
            values, out[name] = d.choices, CategoricalDistribution(d.choices)
        else:
            _check_range(name, d, field)
            assert d.low is not None and d.high is not None  # _check_range refuses a range without them
            if d.type == "int":
                values = [int(d.low), int(d.high)]
                out[name] = IntDistribution(values[0], values[1], log=d.log, step=int(d.step or 1))
            else:
                values, out[name] = [d.low, d.high], FloatDistribution(d.low, d.high, log=d.log, step=d.step)
        for value in values:
            try:
                Hyperparameters.model_validate({**fixed, name: value})
            except ValidationError as e:
                raise refuse(f"{value!r} is not a valid {name}: {e.errors()[0]['msg']}", field) from None
    return out


def distribution_of(d: BaseDistribution) -> Distribution:
    """One of ``distributions``' Optuna distributions back in a request's terms: the dry run's plan
    shows the search space as understood (priors filled in) in the form ``search_space`` takes, for a
    reader and a program alike (an ``int`` range's ``step`` is 1 when the request gave none)."""
    if isinstance(d, CategoricalDistribution):
        return Distribution(type="categorical", choices=list(d.choices))
    assert isinstance(d, (FloatDistribution, IntDistribution))  # the only kinds distributions builds
    kind = "int" if isinstance(d, IntDistribution) else "float"
    return Distribution(type=kind, low=d.low, high=d.high, log=d.log, step=d.step)


def check_models(spec: SweepCreate) -> None:
    """Every base model a trial may get (``search_space.base_model``'s choices, else the spec's) is
    one this server has (``shared.jobs.base_models``: local model directories only, nothing
    downloaded), and takes the longest ``max_length`` a trial may get (fixed, or the searched high).

    Raises:
        UserError: 422 ``unknown_model`` or ``max_length_too_long`` naming the choice and
            ``search_space.base_model.choices`` (or ``base_model``, ``search_space.max_length``).
    """
    searched = spec.search_space.get(BASE_MODEL)
    models, field = (
        (searched.choices or [], f"search_space.{BASE_MODEL}.choices") if searched else ([spec.base_model], BASE_MODEL)
    )
    lengths = spec.search_space.get("max_length")
    longest = (
        spec.hyperparameters.max_length
        if lengths is None
        else int(max(lengths.choices or []) if lengths.type == "categorical" else lengths.high or 0)
    )
    available = available_models()
    for model in models:
        if model_name(model) not in available:
            raise UserError(
                "unknown_model",
                f"{field}: unknown base model {model!r}; available: {', '.join(sorted(available)) or 'none'}"
                f"{hub_hint(model)}",
                field,
            )
        limit = max_input_length(available[model_name(model)][0])
        if limit and longest > limit:
            raise UserError(
                "max_length_too_long",
                f"{field}: {model!r} accepts {limit} tokens, and a trial may get max_length {longest}",
                "search_space.max_length" if lengths else field,
            )


def _check_range(name: str, d: Distribution, field: str) -> None:
    """An ``int`` or ``float`` range's own consistency, and its size (``range_size``)."""
    if d.low is None or d.high is None:
        raise refuse(f"a {d.type} range needs low and high", field)
    if d.low > d.high:
        raise refuse(f"low {d.low:g} is above high {d.high:g}", f"{field}.low")
    if d.log and d.low <= 0:
        raise refuse(f"a log range must start above 0, not at low {d.low:g}", f"{field}.low")
    if d.log and d.step:
        raise refuse("log and step cannot be combined", field)
    if d.type == "float" and name in int_fields(Hyperparameters):
        raise refuse(f"{name} takes integers: use an int range (type int) or categorical choices", f"{field}.type")
    if d.type == "int":
        if not all(float(v).is_integer() for v in (d.low, d.high, d.step or 1)):
            raise refuse("an int range needs integer low, high and step", field)
        for bound in ("low", "high"):
            if abs(getattr(d, bound)) > MAX_RANGE_VALUES:
                raise refuse(
                    f"{bound} {getattr(d, bound):g} is beyond +-2**53 (the integers a float64 holds exactly)",
                    f"{field}.{bound}",
                )
    if (size := range_size(d)) is not None and size > MAX_RANGE_VALUES:
        raise refuse(
            f"step {d.step or 1:g} divides {d.low:g}..{d.high:g} into more than 2**53 values: use a larger "
            f"step{', or none (a continuous range)' if d.type == 'float' else ''}",
            f"{field}.step",
        )


def range_size(d: Distribution) -> int | None:
    """How many values range ``d`` holds (low to high by step; a categorical range's choices), counted
    without listing them (any count over ``MAX_RANGE_VALUES`` as ``MAX_RANGE_VALUES + 1``); None for a
    float range without a step (continuous)."""
    if d.type == "categorical":
        return len(d.choices or ())
    if d.type == "float" and not d.step:
        return None
    assert d.low is not None and d.high is not None  # a range: _check_range refused one without them
    steps = (d.high - d.low) / (d.step or 1)  # inf where the difference overflows
    return int(steps + 1e-9) + 1 if steps < MAX_RANGE_VALUES else MAX_RANGE_VALUES + 1


def check_grid(spec: SweepCreate) -> int:
    """``algorithm: grid``: the grid's points, counted from the ranges (nothing built).

    Raises:
        UserError: 422 ``invalid_search_space`` naming ``search_space.<name>.step`` (a float range
            without a step); ``grid_too_large`` naming ``search_space`` (over ``max_grid_points``).
    """
    sizes: dict[str, int] = {}
    for name, d in spec.search_space.items():
        if (size := range_size(d)) is None:
            raise refuse("a grid over a float range needs a step", f"search_space.{name}.step")
        sizes[name] = size
    points, limit = math.prod(sizes.values()), get_settings().max_grid_points
    if points > limit:
        counts = " x ".join(f"{name} {n:,}" for name, n in sizes.items())
        raise UserError(
            "grid_too_large",
            f"search_space: the grid has {points:.4g} points ({counts}), over this "
            f"server's {limit:,} (TUNEJOB_MAX_GRID_POINTS); use fewer values, or algorithm random or tpe",
            "search_space",
        )
    return points


def grid(spec: SweepCreate) -> dict[str, list[Any]]:
    """``algorithm: grid``: each hyperparameter's values (choices, or low to high by step), for
    Optuna's ``GridSampler``. Call ``check_grid`` first: this lists every value.
    """
    values: dict[str, list[Any]] = {}
    for name, d in spec.search_space.items():
        if d.type == "categorical":
            values[name] = list(d.choices or [])
            continue
        assert d.low is not None and d.high is not None  # a range: distributions() checked its bounds
        if d.type == "int":
            values[name] = list(range(int(d.low), int(d.high) + 1, int(d.step or 1)))
        else:
            assert d.step is not None  # check_grid refuses a float range without a step
            values[name] = [d.low + i * d.step for i in range(range_size(d) or 0)]
    return values
