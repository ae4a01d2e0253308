"""Copies of a validated spec with a few fields changed, validated only where the change
can fail: what fit's enumeration needs for thousands of layouts alike but for their
parallel section and batch split (load_spec of each takes ~0.3 ms)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from vramplan.spec.enums import USER_ERRORS, SpecError, Task, as_spec_error
from vramplan.spec.job import JobSpec, _section, copy_with
from vramplan.spec.optimizers import check_optimizer_fields
from vramplan.spec.sections import ParallelConfig
from vramplan.spec.grpo import GROUP_TASKS, check_generation_batch


def with_dotted(data: Mapping[str, object], changes: Iterable[tuple[str, object]]) -> dict:
    """A copy of the spec mapping `data` with `changes` set; a dotted key reaches into its
    section (`parallel.zero_stage`, `lora.r`), copying that section."""
    out = dict(data)
    for key, value in changes:
        head, _, rest = key.partition(".")
        if rest:  # deeper keys too (`parallel.extras.overlap_comm`)
            inner = out.get(head)
            out[head] = with_dotted(inner if isinstance(inner, Mapping) else {}, [(rest, value)])
        else:
            out[key] = value
    return out


def load_section(name: str, value: object):
    """A spec section (`parallel`, `lora`, ...) from a mapping, validated as load_spec
    validates it; None for None."""
    try:
        return _section(name, value)
    except USER_ERRORS as exc:
        raise as_spec_error(exc) from None


def with_layout(spec: JobSpec, parallel: ParallelConfig, micro_batch_size: int, grad_accum_steps: int) -> JobSpec:
    """`spec` with another parallel section and batch split, valid exactly where load_spec
    of the changed fields would be: `spec` is valid, `parallel` a validated section
    (load_section) and the split positive integers, and JobSpec.__post_init__ reads the
    parallel section and the split only in `check_layout`, which runs here too; every
    field it normalizes reads neither, so each keeps `spec`'s value. A check that reads
    them belongs in check_layout (tests/test_fit_space.py compares this with load_spec).
    What fit's enumeration uses for layouts alike but for these fields (~10 us, where
    load_spec takes ~0.3 ms)."""
    out = copy_with(spec, parallel=parallel, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps)
    check_layout(out)
    return out


def check_layout(spec: JobSpec) -> None:
    """The checks of JobSpec.__post_init__ that read the parallel section or the batch split
    (it calls this too, so the two cannot drift apart)."""
    if (spec.task is Task.DIFFUSION and isinstance(spec.parallel, ParallelConfig)
            and (spec.parallel.model_parallel > 1 or spec.parallel.ep > 1)):
        raise SpecError("parallel", "tensor, pipeline, context and expert parallelism of a diffusion "
                        "denoiser are not modelled yet; use zero_stage or fsdp")
    check_optimizer_fields(spec)
    spec._check_float8()
    check_generation_batch(spec)


def split_checked(spec: JobSpec) -> bool:
    """Whether check_layout reads the batch split itself, not only the rows per rank it
    divides (what every split of a layout shares): GRPO's explicit generation batch holds
    whole micro-batches (spec/grpo.py check_generation_batch). A search that copies a
    validated layout to other splits checks each split of such a layout again."""
    return spec.task in GROUP_TASKS


__all__ = ["check_layout", "load_section", "split_checked", "with_dotted", "with_layout"]
