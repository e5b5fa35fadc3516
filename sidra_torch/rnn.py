"""The fused LSTM and GRU cells PyTorch sends to accelerators.

`nn.LSTM`/`nn.GRU` (and `LSTMCell`/`GRUCell`) on a CUDA or PrivateUse1 device
compute the gate matmuls as ordinary linears (crossbar MVMs here) and hand
the rest of each step to one fused kernel, `_thnn_fused_lstm_cell` /
`_thnn_fused_gru_cell`, plus its backward; the CPU has none of these, so
without them an RNN on the device fails. The math below is CUDA's
(aten/src/ATen/native/cuda/RNN.cu), workspace layout included, written once
over `act` (the non-linearities) and `fin` (storing an element-wise result):
the engine's kernels and rounding on the device, plain torch on the host.
"""

from __future__ import annotations

import torch


def _host_act(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if name == "sigmoid" else torch.tanh(x)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    g = input_gates + hidden_gates
    if input_bias is not None:
        g = g + input_bias
    if hidden_bias is not None:
        g = g + hidden_bias
    return g


def lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None, *, act=_host_act, fin=_same):
    """One LSTM step from its gate pre-activations (N, 4H): (hy, cy, workspace of the activated gates)."""
    i, f, g, o = fin(_gates(input_gates, hidden_gates, input_bias, hidden_bias)).chunk(4, 1)
    i, f, g, o = act("sigmoid", i), act("sigmoid", f), act("tanh", g), act("sigmoid", o)
    cy = fin(f * cx + i * g)
    hy = fin(o * act("tanh", cy))
    return hy, cy, torch.cat([i, f, g, o], 1)


def lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias: bool):
    """Gradients of one LSTM step: (grad of the gates (N, 4H), grad of cx, grad of the bias or None)."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = torch.tanh(cy)
    grad_hy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = torch.cat([grad_c * g * (1 - i) * i, grad_c * cx * (1 - f) * f, grad_c * i * (1 - g * g),
                            grad_hy * tanh_cy * (1 - o) * o], 1)
    return grad_gates, grad_c * f, grad_gates.sum(0) if has_bias else None


def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None, *, act=_host_act, fin=_same):
    """One GRU step from its gate pre-activations (N, 3H): (hy, workspace = [r, z, n, hx, hidden n])."""
    i_r, i_z, i_n = (input_gates if input_bias is None else input_gates + input_bias).chunk(3, 1)
    h_r, h_z, h_n = (hidden_gates if hidden_bias is None else hidden_gates + hidden_bias).chunk(3, 1)
    r = act("sigmoid", fin(i_r + h_r))
    z = act("sigmoid", fin(i_z + h_z))
    n = act("tanh", fin(i_n + r * h_n))
    hy = fin(n + z * (hx - n))
    return hy, torch.cat([r, z, n, hx, h_n], 1)


def gru_cell_backward(grad_hy, workspace, has_bias: bool):
    """Gradients of one GRU step: (input gates, hidden gates, hx, input bias, hidden bias)."""
    r, z, n, hx, h_n = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * h_n * (1 - r) * r
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_n * r], 1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)
