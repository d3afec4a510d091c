"""The Programs of one planned model, one per input signature (each traced once).

A :class:`~axonn_jax.partitioner.program.Program` is planned for the example
inputs given to ``partition()``; a call with other shapes (a bigger batch,
another sequence length) needs the Program of those inputs, with the same
parameter layout (:func:`~axonn_jax.partitioner.program.program_for` plans its
values around the plan's parameter layouts). :class:`ProgramCache` traces each signature
once; both engines and the step reports read their Programs from it. It needs
no devices.

Example:
    >>> programs = ProgramCache(model, plan, program, options)        # doctest: +SKIP
    >>> programs.for_call((tokens,), {}).out_tree                     # doctest: +SKIP
"""

from __future__ import annotations

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import PlanOptions, Program, call_signature, program_for
from axonn_jax.partitioner.trace import call_leaves


class ProgramCache:
    """Programs of ``model`` planned as ``plan``, by input signature (``program``: the example's)."""

    def __init__(self, model, plan: Plan, program: Program, options: PlanOptions):
        self.model, self.plan, self.options = model, plan, options
        self.example = program
        self._programs: dict = {program.signature: program}

    def for_call(self, args: tuple, kwargs: dict) -> Program:
        """The :class:`Program` for a call with these inputs (traced once per signature)."""
        key = call_signature(args, kwargs)
        if key not in self._programs:
            try:
                self._programs[key] = program_for(self.model, self.plan, args, kwargs, example=self.example.traced,
                                                  options=self.options)  # fmt: skip
            except TypeError as err:
                example = len(self.example.traced.example_call()[0])
                if "positional argument" not in str(err) or len(args) == example:
                    self._raise_for_feature_dims(err, args, kwargs)
                    raise
                raise TypeError(
                    f"{err}: the model was called with {len(args)} positional inputs where the example "
                    f"call given to partition() had {example}. A training call passes the whole batch "
                    "unless told which part the model takes. Remedy: inputs=, e.g. "
                    f"pm.train_step(loss_fn, optimizer, inputs=lambda batch: batch[:{example}]) (or "
                    "pm.value_and_grad(loss_fn, inputs=...)) for a batch of (inputs, targets)."
                ) from err
        return self._programs[key]

    def _raise_for_feature_dims(self, err: TypeError, args: tuple, kwargs: dict) -> None:
        """A tracing error of inputs whose dims past the batch differ from the example's (an nnx
        model's layers hold their parameters, so tracing meets the example's shapes): say so."""
        now = [tuple(getattr(x, "shape", ())) for x in call_leaves(args, kwargs)[0]]
        was = [tuple(a.shape) for a in self.example.traced.arg_avals]
        if len(now) == len(was) and any(a[1:] != b[1:] for a, b in zip(now, was)):
            raise TypeError(
                f"{err}: the model was called with inputs of shapes {now} where the example inputs given to "
                f"partition() had {was}; its parameters have the shapes those made. Remedy: call with the "
                "example's dims past the batch, or partition (and initialise) with inputs of these shapes."
            ) from err
