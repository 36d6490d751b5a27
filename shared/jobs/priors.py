"""Default ranges ("priors") for a sweep's common hyperparameters, by the base model's size: a search
space may name ``learning_rate``, ``batch_size``, ``warmup_ratio``, ``weight_decay`` or ``epochs``
without a range (``{}`` or only its ``type``), and ``fill`` gives it the range of ``PRIORS``.

The size is counted, not guessed from a name: the parameters in the model's safetensors files (their
headers only, through ``safetensors.safe_open``), small below 60 M (MiniLM-L6 22.7 M, ELECTRA-small
14 M), base below 200 M (BERT-base 110 M, RoBERTa-base 125 M), large above (BERT-large 340 M,
RoBERTa-large 355 M).

The ranges span what the encoders' papers fine-tuned with on GLUE (docs/guide/sweeps.md, "Priors"):

- BERT (Devlin et al. 2019, appendix A.3): learning rate {5e-5, 4e-5, 3e-5, 2e-5}, batch {16, 32},
  epochs {2, 3, 4}, 10% warmup, weight decay 0.01;
- RoBERTa (Liu et al. 2019, table 10): learning rate {1e-5, 2e-5, 3e-5}, batch {16, 32}, 6% warmup,
  weight decay 0.1, 10 epochs;
- ELECTRA (Clark et al. 2020, table 7): learning rate 3e-4 small, 1e-4 base, 5e-5 large, 10% warmup,
  weight decay 0, 3 epochs (10 on the small RTE and STS);
- Mosbach et al. 2021 (On the Stability of Fine-tuning BERT): failed runs on small data come from
  vanishing gradients early in training, not from forgetting; small learning rates with warmup and
  more epochs make fine-tuning stable, most of all for large models.

Every range holds tunejob's own defaults (learning rate 5e-5, batch 16, warmup 0.1, weight decay
0.01, 3 epochs), so the default trial (``include_defaults``) runs exactly the default job.
"""

import math

from shared.errors import UserError
from shared.jobs.base_models import resolve_model
from shared.schemas.sweeps import Distribution, SweepCreate

SIZES = (("small", 60e6), ("base", 200e6), ("large", math.inf))  # (size, parameters below)


def _shared(epochs_high: int) -> dict[str, Distribution]:
    return {
        "batch_size": Distribution(type="categorical", choices=[16, 32]),
        "warmup_ratio": Distribution(type="float", low=0.0, high=0.1),
        "weight_decay": Distribution(type="float", low=0.0, high=0.1),
        "epochs": Distribution(type="int", low=2, high=epochs_high),
    }


PRIORS: dict[str, dict[str, Distribution]] = {
    "small": {"learning_rate": Distribution(type="float", low=3e-5, high=3e-4, log=True), **_shared(5)},
    "base": {"learning_rate": Distribution(type="float", low=1e-5, high=1e-4, log=True), **_shared(4)},
    "large": {"learning_rate": Distribution(type="float", low=5e-6, high=5e-5, log=True), **_shared(10)},
}


def parameter_count(base_model: str) -> int:
    """The parameters of base model ``base_model`` (every tensor of its safetensors files, read
    from their headers). Raises: UserError ``unknown_model``."""
    from safetensors import safe_open

    total = 0
    for path in sorted(resolve_model(base_model).glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def model_size(base_model: str) -> str:
    """``small``, ``base`` or ``large`` by ``parameter_count`` (``SIZES``)."""
    count = parameter_count(base_model)
    return next(size for size, below in SIZES if count < below)


def wants_prior(d: Distribution) -> bool:
    """A range left for tunejob to fill: no bounds, no choices, no step."""
    return d.low is None and d.high is None and d.choices is None and d.step is None


def fill(spec: SweepCreate) -> SweepCreate:
    """``spec`` with each range of ``PRIORS``'s fields that ``wants_prior`` (and names no type, or
    the prior's) given the prior of the base model's size; other ranges as they are (a range
    without a type that is not one of them: ``shared.jobs.search_space.distributions`` refuses it).

    With no search space at all, every field of ``PRIORS`` that ``spec.hyperparameters`` does not
    set is searched (as ``Trainer.hyperparameter_search`` searches its default space when given none).

    Raises:
        UserError: ``unknown_model`` (only when a range is to be filled); ``invalid_search_space``
            naming ``search_space`` when it is empty and ``hyperparameters`` sets every field of ``PRIORS``.
    """
    if not spec.search_space:
        unset = [name for name in PRIORS["base"] if name not in spec.hyperparameters.model_fields_set]
        if not unset:
            raise UserError(
                "invalid_search_space",
                f"search_space: none given, and hyperparameters fixes every one tunejob would search "
                f"({', '.join(PRIORS['base'])}): name the ranges to search",
                "search_space",
            )
        spec = spec.model_copy(update={"search_space": {name: Distribution() for name in unset}})
    names = [
        name
        for name, d in spec.search_space.items()
        if wants_prior(d) and name in PRIORS["base"] and d.type in (None, PRIORS["base"][name].type)
    ]
    if not names:
        return spec
    priors = PRIORS[model_size(spec.base_model)]
    return spec.model_copy(update={"search_space": {**spec.search_space, **{n: priors[n] for n in names}}})
