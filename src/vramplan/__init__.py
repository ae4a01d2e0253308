"""vramplan: per-GPU peak memory of a training step, in named terms, checked against measurements."""
from vramplan.spec import JobSpec, SpecError, load_spec, save_spec
from vramplan.check import DoesNotFitError, check  # noqa: E402  (the function shadows the module name)

__version__ = "0.1.0"


def estimate(spec, **overrides):
    """Estimate one GPU's memory for a job (a JobSpec, mapping or spec file path).
    Bad input raises SpecError (a ValueError) whose `field` names the spec field."""
    from vramplan.estimation import estimate as _estimate
    from vramplan.spec.enums import _USER_ERRORS, as_spec_error
    job = load_spec(spec, **overrides) if overrides or not isinstance(spec, JobSpec) else spec
    try:
        return _estimate(job)
    except _USER_ERRORS as exc:
        raise as_spec_error(exc) from None


__all__ = ["DoesNotFitError", "JobSpec", "SpecError", "check", "estimate", "load_spec", "save_spec", "__version__"]
