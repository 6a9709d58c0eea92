"""Adam over a small network's parameters laid out in one flat tensor per parameter group.

A PPO mini-batch step on a classic-control MLP (two 64-64 networks, a dozen parameter tensors, 64 samples) is
bound by the fixed cost of each tensor operation and of ``Optimizer.step``'s Python dispatch, not by arithmetic.
``FlatAdam`` moves every parameter of a group into one contiguous tensor, the parameters and their gradients
becoming views of it, so that zeroing the gradients, measuring and clipping their norm and the Adam update each
run on one or two tensors instead of a dozen. The model keeps its own parameters (its ``state_dict``, its
forward pass and autograd are unchanged); backward accumulates into the gradient views in place.

Adam is element-wise, so one fused update of a group's flat tensor is the update of each of its parameters,
step for step; only the global gradient norm is summed in another order (one reduction instead of a norm of
per-tensor norms), which moves it in the last bits of float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from unipg.learn.common import clip_plain_grads


def flatten_group(parameters: list[nn.Parameter], grad: torch.Tensor) -> nn.Parameter:
    """The flat parameter of ``parameters``, which become views of it, values kept, and their gradients views of
    ``grad`` (zeros of their total size, which becomes the flat parameter's gradient).

    The flat parameter is what the optimizer steps; it never enters a forward pass, so its ``grad`` is set here
    once and is the same tensor for the whole run.
    """
    flat = torch.cat([p.detach().reshape(-1) for p in parameters])
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.data = flat[offset : offset + size].view_as(parameter)
        parameter.grad = grad[offset : offset + size].view_as(parameter)
        offset += size
    flat_parameter = nn.Parameter(flat)
    flat_parameter.grad = grad
    return flat_parameter


class FlatAdam:
    """Fused Adam on one flat tensor per parameter group (``groups``: [(parameters, lr)]), with the gradient
    zeroing and norm clipping that go with it.

    ``optimizer`` is a plain ``torch.optim.Adam`` over the flat tensors: checkpoints, learning-rate changes
    (``param_groups[i]["lr"]``) and its first step, which creates its state, go through it. Later steps call the
    fused kernel that ``Adam.step`` calls, with the same state tensors and hyperparameters, without its
    per-call dispatch (profiling hooks, grouping by device, fallback checks), which on this size costs more
    than the update.
    """

    def __init__(self, groups: list[tuple[list[nn.Parameter], float]], *, eps: float):
        first = groups[0][0][0]
        sizes = [sum(parameter.numel() for parameter in parameters) for parameters, _ in groups]
        # every group's gradient, one after the other: zeroing and the norm clip are one operation each
        self.grad = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        self.grads = list(self.grad.split(sizes))  # each group's flat gradient, a view of ``grad``
        flats = [flatten_group(parameters, grad) for (parameters, _), grad in zip(groups, self.grads)]
        self.flats = flats
        self.parameters = [parameter for parameters, _ in groups for parameter in parameters]
        self.optimizer = torch.optim.Adam(
            [{"params": [flat], "lr": lr, "base_lr": lr} for flat, (_, lr) in zip(flats, groups)], eps=eps, fused=True
        )

    def zero_grad(self) -> None:
        """Zero the gradients in place: backward then adds into the views that the parameters' ``grad`` are."""
        self.grad.zero_()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm`` (None: only measure it), as
        ``torch.nn.utils.clip_grad_norm_`` does; returns the pre-clip norm as a 0-d tensor, so that the caller
        decides when to read it."""
        return clip_plain_grads([self.grad], math.inf if max_norm is None else max_norm)

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step of every group, as ``self.optimizer.step()`` would take it.

        The parameters' version counters move as if they had been written in place: they are views of the flat
        tensors through ``.data``, which does not share the flat tensor's counter. Autograd then refuses a graph
        that saved their old values, and caches of the weights (``MLPActorCritic.act``) see the change."""
        self._adam_step()
        torch.autograd.graph.increment_version(self.parameters)

    def _adam_step(self) -> None:
        states = [self.optimizer.state.get(flat) for flat in self.flats]
        if any(state is None for state in states):
            self.optimizer.step()  # creates the state (step, exp_avg, exp_avg_sq), as Adam does lazily
            return
        torch._foreach_add_([state["step"] for state in states], 1)
        # groups with the same hyperparameters (actor and critic at one learning rate) take one fused call
        calls: dict[tuple, list[tuple[nn.Parameter, dict]]] = {}
        for group, flat, state in zip(self.optimizer.param_groups, self.flats, states):
            calls.setdefault((group["lr"], *group["betas"], group["eps"]), []).append((flat, state))
        for (lr, beta1, beta2, eps), members in calls.items():
            torch._fused_adam_(
                [flat for flat, _ in members],
                [flat.grad for flat, _ in members],
                [state["exp_avg"] for _, state in members],
                [state["exp_avg_sq"] for _, state in members],
                [],
                [state["step"] for _, state in members],
                amsgrad=False,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=0.0,
                eps=eps,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )


def merge_per_parameter_state(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An Adam checkpoint (``unipg.learn.state.optimizer_tensors``) written with one state per parameter tensor,
    as learners did before ``FlatAdam``, rewritten for one flat tensor per group: each group's moments are its
    parameters' moments flattened and concatenated in the group's order, which is the layout ``flatten_group``
    gives the parameters. A checkpoint that already has one parameter per group is returned as it is."""
    groups = meta["param_groups"]
    if all(len(group["params"]) == 1 for group in groups):
        return tensors, meta
    merged: dict[str, torch.Tensor] = {}
    merged_groups, merged_state = [], {}
    for index, group in enumerate(groups):
        members = [str(param) for param in group["params"]]
        if any(f"state.{param}.exp_avg" not in tensors for param in members):
            raise ValueError(
                f"the optimizer checkpoint has no Adam moments for some parameters of group {index}; "
                "it cannot be continued with flat parameters: start the run afresh"
            )
        for key in ("exp_avg", "exp_avg_sq"):
            merged[f"state.{index}.{key}"] = torch.cat(
                [tensors[f"state.{param}.{key}"].reshape(-1) for param in members]
            )
        merged[f"state.{index}.step"] = tensors[f"state.{members[0]}.step"].clone()  # every parameter took every step
        merged_state[str(index)] = meta["state"].get(members[0], {})
        merged_groups.append({**group, "params": [index]})
    return merged, {**meta, "state": merged_state, "param_groups": merged_groups}
