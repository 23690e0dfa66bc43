"""How smelt defines the operators it writes in Python: one namespace, one way.

Every such operator lives in ``torch.ops.smelt`` and is registered by :func:`define`: its
schema, its implementation, its fake (so ``torch.compile(fullgraph=True)`` traces it) and,
where it has one, its autograd. :class:`KernelOp` builds what each kernel op of smelt is made
of from a description of its arguments:

* a forward operator ``smelt::<op>_fwd`` that runs the implementation the registry chose
  (:mod:`smelt_kernels.backends`; the backend's name is its last argument);
* a backward operator ``smelt::<op>_bwd`` (or a composite backward of other operators), and
  the autograd that saves what it needs and connects the two;
* the call path: the registry's choice, the host check of argument values where it may read
  them (always on CPU tensors, inside the forward; on other devices before it, unless the
  caller opts out or the call is compiled or captured), and for calls autograd does not
  record the implementation's ``infer`` entry point, which skips the operators.

An op's ``ops.py`` then holds its validation, its registrations and a ``KernelOp``.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional, Sequence

import torch

from . import backends

__all__ = ["LIB", "define", "KernelOp"]

#: the library of every operator defined in Python (``torch.ops.smelt``)
LIB = torch.library.Library("smelt", "FRAGMENT")


def _dense(out):
    """``out`` (a tensor, or a tuple or list of them and other values) with every tensor
    contiguous: the one layout an operator's outputs have, real and fake alike."""
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, (tuple, list)):
        return type(out)(_dense(o) for o in out)
    return out


def define(
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    backward: Optional[Callable[..., Any]] = None,
    setup_context: Optional[Callable[..., Any]] = None,
):
    """Register ``smelt::<name><schema>`` with ``impl`` (for every device), its ``fake`` and,
    when given, its autograd (``backward``, ``setup_context``: as
    ``torch.library.register_autograd`` takes them). Returns ``torch.ops.smelt.<name>``.

    Every output tensor of the operator is contiguous, from ``impl`` and from ``fake`` alike:
    the compiler plans its buffers from the fake's strides and checks the real ones against
    them, and an implementation may hand back a view in another layout (a transposed
    log-sum-exp, heads packed with positions), which only sizes of one hide."""
    LIB.define(f"{name}{schema}")
    LIB.impl(name, lambda *a, **kw: _dense(impl(*a, **kw)), "CompositeExplicitAutograd")
    torch.library.register_fake(f"smelt::{name}", lambda *a, **kw: _dense(fake(*a, **kw)), lib=LIB)
    if backward is not None:
        torch.library.register_autograd(
            f"smelt::{name}", backward, setup_context=setup_context, lib=LIB
        )
    return getattr(torch.ops.smelt, name)


def _parse(args: str) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """``"Tensor x, bool flag=True"`` -> ``[("Tensor", "x"), ("bool", "flag")]`` and the
    defaults, ``{"flag": True}``."""
    out, defaults = [], {}
    for part in args.split(","):
        decl, _, default = part.partition("=")
        kind, name = decl.split()
        out.append((kind, name))
        if default:
            defaults[name] = ast.literal_eval(default.strip())
    return out, defaults


def _returns(n: int) -> str:
    return "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"


class KernelOp:
    """One kernel op: its forward and backward operators, their fakes, its autograd and its
    call path (see the module docstring).

    ``inputs``: the forward's arguments as schema text (``"Tensor x, Tensor? ids, float
    scale, str backend"``), one of them ``str backend`` (the registry's choice goes there).
    ``outputs``: the names of its outputs (all
    tensors); ``public``: how many of them a call returns (the leading ones).
    ``differentiable``: the inputs that get gradients, in the order the backward returns
    them; ``grads``: the outputs whose gradients the backward takes (default: the first);
    the other outputs are not differentiable. ``saves``: inputs and outputs (by name) the
    backward reads after the gradients; ``backward_attrs``: the non-tensor inputs that
    follow them (then the backend's name).
    ``forward(impl, *inputs)`` / ``backward(impl, *grads, *saved, *attrs)``: run the chosen
    implementation (default: ``impl.forward(*inputs)``, ``impl.backward(*grads, *saved)``).
    ``fake`` / ``backward_fake``: their fake implementations (the backward's default: empty
    tensors shaped like the differentiable inputs, which must then be saved).
    ``composite_backward(ctx_saved, grads, attrs, needs, backend)``: instead of a backward
    operator, a function of other operators (``needs``: which differentiable inputs want a
    gradient). ``check(*inputs)``: the host check of argument values (raises ValueError);
    ``check_cpu=False`` when the forward checks CPU inputs itself.
    ``grad_input``: a ``bool`` input the call path sets to whether autograd records the call
    (so the forward keeps what the backward needs only then). ``fwd_name`` / ``bwd_name``:
    the operators' names (default ``<op>_fwd`` / ``<op>_bwd``).
    """

    def __init__(
        self,
        op: str,
        *,
        inputs: str,
        outputs: Sequence[str],
        differentiable: Sequence[str],
        saves: Sequence[str],
        fake: Callable[..., Any],
        public: int = 1,
        grads: Optional[Sequence[str]] = None,
        forward: Optional[Callable[..., Any]] = None,
        backward: Optional[Callable[..., Any]] = None,
        backward_fake: Optional[Callable[..., Any]] = None,
        composite_backward: Optional[Callable[..., Any]] = None,
        check: Optional[Callable[..., None]] = None,
        check_cpu: bool = True,
        grad_input: Optional[str] = None,
        backward_attrs: Sequence[str] = (),
        fwd_name: Optional[str] = None,
        bwd_name: Optional[str] = None,
    ):
        self.op = op
        args, self._defaults = _parse(inputs)
        self._all_names = [n for _, n in args]
        self._backend_at = self._all_names.index("backend")
        self.args = [a for a in args if a[1] != "backend"]
        self.names = [n for _, n in self.args]
        self.outputs = tuple(outputs)
        self.public = public
        self.differentiable = tuple(differentiable)
        self.grads = tuple(grads) if grads is not None else self.outputs[:1]
        self.saves = tuple(saves)
        self.attrs = tuple(backward_attrs)
        self.check = check
        self.check_cpu = check_cpu and check is not None
        self.grad_input = grad_input
        self._diff_pos = [self.names.index(n) for n in self.differentiable]
        self._forward = forward
        self._backward = backward
        self._composite = composite_backward
        fwd_name = fwd_name or f"{op}_fwd"
        self.forward_op = define(
            fwd_name,
            f"({inputs}) -> {_returns(len(outputs))}",
            self._run_forward,
            lambda *a, **kw: fake(*self._split(a, kw)[0]),
            backward=self._autograd,
            setup_context=self._setup,
        )
        self.backward_op = None
        if composite_backward is None:
            saved_schema = [self._kind(n) for n in self.saves]
            attrs = [f"{k} {n}" for k, n in self.args if n in self.attrs]
            schema = ", ".join(
                [f"Tensor grad_{g}" for g in self.grads]
                + [f"{k} {n}" for k, n in zip(saved_schema, self.saves)]
                + attrs
                + ["str backend"]
            )
            self.backward_op = define(
                bwd_name or f"{op}_bwd",
                f"({schema}) -> {_returns(len(self.differentiable))}",
                self._run_backward,
                lambda *a: (backward_fake or self._backward_fake)(*a[:-1]),
            )

    # ------------------------------------------------------------------ operators
    def _kind(self, name: str) -> str:
        for kind, n in self.args:
            if n == name:
                return kind
        return "Tensor"  # an output

    def _split(self, args, kwargs=None) -> tuple[tuple, str]:
        """The forward operator's arguments -> (the op's inputs, the backend's name). The
        dispatcher leaves out trailing arguments that equal their defaults: put them back."""
        if len(args) < len(self._all_names):
            rest = [
                (kwargs or {}).get(n, self._defaults.get(n)) for n in self._all_names[len(args) :]
            ]
            args = tuple(args) + tuple(rest)
        at = self._backend_at
        return tuple(args[:at]) + tuple(args[at + 1 :]), args[at]

    def _join(self, inputs, backend: str) -> tuple:
        at = self._backend_at
        return tuple(inputs[:at]) + (backend,) + tuple(inputs[at:])

    def _run_forward(self, *args, **kwargs):
        inputs, backend = self._split(args, kwargs)
        impl = backends.implementation(self.op, backend)
        if self.check_cpu and not impl.checks_values and _first_tensor(inputs).device.type == "cpu":
            self.check(*inputs)
        out = self._forward(impl, *inputs) if self._forward else impl.forward(*inputs)
        return out

    def _run_backward(self, *args):
        *rest, backend = args
        impl = backends.implementation(self.op, backend)
        if self._backward is not None:
            return self._backward(impl, *rest)
        n = len(self.grads) + len(self.saves)
        return impl.backward(*rest[:n])

    def _backward_fake(self, *args):
        saved = dict(zip(self.saves, args[len(self.grads) :]))
        out = tuple(saved[n].new_empty(saved[n].shape) for n in self.differentiable)
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ autograd
    def _setup(self, ctx, inputs, output):
        inputs, backend = self._split(inputs)
        named = dict(zip(self.names, inputs))
        outs = dict(zip(self.outputs, output if isinstance(output, tuple) else (output,)))
        ctx.save_for_backward(*(named[n] if n in named else outs[n] for n in self.saves))
        ctx.attrs = tuple(named[n] for n in self.attrs)
        impl = backends.implementation(self.op, backend)
        ctx.backend = backends.backward_impl(impl, _first_tensor(inputs).device).backend
        nondiff = [outs[n] for n in self.outputs if n not in self.grads]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)

    def _autograd(self, ctx, *grad_outputs):
        named = dict(zip(self.outputs, grad_outputs))
        grads = [named[g] for g in self.grads]
        result: list[Optional[torch.Tensor]] = [None] * len(self.names)
        needs = [ctx.needs_input_grad[i + (i >= self._backend_at)] for i in self._diff_pos]
        if all(g is None for g in grads) or not any(needs):
            return self._join(result, None)
        saved = ctx.saved_tensors
        if self._composite is not None:
            out = self._composite(saved, grads, ctx.attrs, needs, ctx.backend)
        else:
            grads = [g.contiguous() for g in grads]
            out = self.backward_op(*grads, *saved, *ctx.attrs, ctx.backend)
        out = out if isinstance(out, tuple) else (out,)
        for pos, need, g in zip(self._diff_pos, needs, out):
            result[pos] = g if need else None
        return self._join(result, None)

    # ------------------------------------------------------------------ the call path
    def __call__(self, *inputs, backend: Optional[str] = None, check_values: Optional[bool] = None):
        """Run the op on validated ``inputs`` (all forward arguments but ``grad_input``):
        returns its ``public`` outputs (one tensor when ``public`` is 1)."""
        if self.grad_input is not None:
            at = self.names.index(self.grad_input)
            inputs = inputs[:at] + (None,) + inputs[at:]
        impl = backends.select(self.op, *inputs, backend=backend).implementation
        first = _first_tensor(inputs)
        cpu = first.device.type == "cpu"
        if (
            self.check is not None
            and not cpu
            and check_values is not False
            and backends.can_read_values(first)
        ):
            self.check(*inputs)
        if impl.direct:  # plain differentiable torch code: autograd records its own ops
            if self.check_cpu and cpu:
                self.check(*inputs)
            return impl.forward(*inputs)
        grad = backends.needs_grad(*(inputs[i] for i in self._diff_pos))
        if self.grad_input is not None:
            inputs = inputs[:at] + (grad,) + inputs[at + 1 :]
        if not grad and impl.infer is not None:
            if self.check_cpu and cpu and not impl.checks_values:
                self.check(*inputs)
            out = impl.infer(*inputs)
            if out is not None:
                return out
        out = self.forward_op(*self._join(inputs, impl.backend))
        if self.public == 1:
            return out[0] if isinstance(out, tuple) else out
        return out[: self.public]


def _first_tensor(values) -> torch.Tensor:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError("an op was called without a tensor argument")
