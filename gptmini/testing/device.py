"""Does this device compute gptmini's model correctly? A parity check against CPU float64.

    from gptmini.testing.device import check_device
    print(check_device("mps"))

    python -m gptmini.testing --device mps

The same small GPT, with the same weights and the same tokens, runs a forward pass, a
backward pass and one AdamW step on the device (in each dtype, with each attention backend)
and on the CPU in float64. Forward hooks record every module's output on both; the report
names the first module, in the order they ran, whose output drifts beyond the dtype's
tolerance, then the first parameter whose gradient does, then the first whose updated value
does, with the torch version. Errors are relative to the size of the reference tensor, so
one tolerance fits every layer. Only public `nn.Module` hooks are used: the check runs on
whatever the model's modules are.
"""

import dataclasses
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptmini.attention import kernels
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2,
             torch.bfloat16: 6e-2}
"""Largest |device - float64| / max |float64| a tensor may show, per dtype. float32 keeps
about 7 digits and a small model loses some to rounding; half types keep 3 (float16) or 2
(bfloat16)."""
DEFAULT_BACKENDS = ("sdpa", "explicit", "tiled")
"""Attention kernels checked by default (flex compiles for minutes: ask for it by name)."""


@dataclass
class Drift:
    """The first tensor beyond tolerance in one phase."""

    phase: str
    """"forward", "backward" or "optimizer step"."""
    where: str
    """The module (with its type) or the parameter."""
    error: float
    """|device - float64| / max |float64|."""


@dataclass
class Case:
    """One dtype and backend on the device."""

    dtype: torch.dtype
    backend: str
    tolerance: float
    worst: float = 0.0
    """The largest relative error seen anywhere."""
    drift: Drift | None = None
    error: str | None = None
    """The device refused or failed this case (one line)."""
    skipped: str | None = None
    """Why this case cannot run on the device by design (it neither passes nor fails)."""

    @property
    def passed(self) -> bool:
        return self.drift is None and self.error is None

    def line(self) -> str:
        name = f"{str(self.dtype).removeprefix('torch.'):<9} {self.backend:<9}"
        if self.skipped:
            return f"skip {name} {self.skipped}"
        if self.error:
            return f"ERR  {name} {self.error}"
        if self.drift:
            d = self.drift
            return (f"FAIL {name} {d.phase}: {d.where} drifts by {d.error:.2e} (tolerance "
                    f"{self.tolerance:.0e}); all before it within")
        return f"ok   {name} worst {self.worst:.1e} (tolerance {self.tolerance:.0e})"


@dataclass
class DeviceReport:
    device: str
    versions: str
    cases: list[Case] = field(default_factory=list)

    @property
    def checked(self) -> int:
        """Cases that ran (not skipped)."""
        return sum(c.skipped is None for c in self.cases)

    @property
    def passed(self) -> bool:
        """No case failed, and at least one ran: a report of skips alone proves nothing."""
        return self.checked > 0 and all(c.passed for c in self.cases)

    def __str__(self) -> str:
        lines = [f"device parity: {self.device} against cpu float64", self.versions, ""]
        lines += [c.line() for c in self.cases]
        failed = sum(not c.passed for c in self.cases)
        skipped = len(self.cases) - self.checked
        lines += ["", f"{self.checked - failed} passed, {failed} failed"
                      + (f", {skipped} skipped" if skipped else "")
                      + ": forward, backward and one AdamW step of a small GPT on the same "
                        "weights and tokens"]
        if not self.checked:
            lines.append("nothing was checked: name a backend that runs on this device")
        return "\n".join(lines)


def _relative(a: Tensor, reference: Tensor) -> float:
    a, reference = a.detach().to("cpu", torch.float64), reference.detach().to(torch.float64)
    if a.shape != reference.shape:
        return float("inf")
    if not a.isfinite().all() and reference.isfinite().all():
        return float("inf")
    scale = reference.abs().max().item() or 1.0
    return (a - reference).abs().max().item() / scale


def _record(model: nn.Module) -> tuple[list[tuple[str, Tensor]], list]:
    """Every module's output in the order the modules ran (first tensor of a tuple)."""
    seen: list[tuple[str, Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if module is model:
            continue

        def hook(mod, args, out, name=name):
            out = out[0] if isinstance(out, tuple | list) and out else out
            if isinstance(out, Tensor) and out.is_floating_point():
                seen.append((f"{name} ({type(mod).__name__})", out.detach()))
        handles.append(module.register_forward_hook(hook))
    return seen, handles


def _run(model: nn.Module, ids: Tensor, targets: Tensor) -> tuple[list, Tensor]:
    seen, handles = _record(model)
    try:
        logits = model(ids)  # (b, num_tokens, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    finally:
        for h in handles:
            h.remove()
    seen.append(("the loss (cross-entropy)", loss.detach()))
    loss.backward()
    return seen, loss


def _step(model: nn.Module) -> None:
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False).step()


def check_case(device: torch.device, dtype: torch.dtype, backend: str, cfg: GPTConfig,
               seed: int = 0, alter: Callable[[nn.Module], None] | None = None) -> Case:
    """One dtype and backend: forward, backward and an AdamW step against CPU float64."""
    case = Case(dtype, backend, TOLERANCE.get(dtype, 6e-2))
    if device.type == "cpu" and not getattr(kernels.KERNELS[backend], "cpu_backward", True):
        case.skipped = (f"{backend} has no backward pass on CPU (torch {torch.__version__}); "
                        f"check {backend} on a GPU")
        return case
    cfg = dataclasses.replace(cfg, attention_backend=backend, drop_rate=0.0,
                              attn_drop_rate=None)
    torch.manual_seed(seed)
    reference = init_gpt2_weights(GPTModel(dataclasses.replace(
        cfg, attention_backend="explicit"))).double().train()  # a run's start: GPT-2's scales
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=generator)
    want, _ = _run(reference, ids, targets)
    try:
        model = GPTModel(cfg)
        model.load_state_dict(weights)
        model = model.to(device=device, dtype=dtype).train()
        if alter is not None:
            alter(model)
        got, _ = _run(model, ids.to(device), targets.to(device))
    except Exception as err:  # noqa: BLE001 - a device or kernel refusing: said in the report
        case.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:150]}"
        return case
    phases = [("forward", list(zip(got, want, strict=False)))]
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    phases.append(("backward", [((f"{n}.grad", params[n].grad), (n, p.grad))
                                for n, p in ref_params.items() if p.grad is not None]))
    # The step gets the float64 gradients, so it tests the optimizer's arithmetic on the
    # device: Adam divides by |g| + eps, which would amplify the backward's rounding in
    # near-zero gradients into whole updates of the wrong sign.
    for name, p in ref_params.items():
        if p.grad is not None:
            params[name].grad = p.grad.to(device=device, dtype=params[name].dtype)
    _step(model)
    _step(reference)
    phases.append(("optimizer step", [((n, params[n]), (n, p))
                                      for n, p in ref_params.items()]))
    for phase, pairs in phases:
        for (name, value), (_, expected) in pairs:
            error = _relative(value, expected) if value is not None else float("inf")
            case.worst = max(case.worst, error)
            if error > case.tolerance and case.drift is None:
                case.drift = Drift(phase, name, error)
        if case.drift is not None:
            break
    return case


def check_device(device: str | torch.device, dtypes: tuple[torch.dtype, ...] = (
        torch.float32, torch.bfloat16), backends: tuple[str, ...] = DEFAULT_BACKENDS, *,
                 cfg: GPTConfig | None = None,
                 alter: Callable[[nn.Module], None] | None = None) -> DeviceReport:
    """Forward, backward and one optimizer step of a small GPT on `device`, in each of
    `dtypes` and with each attention backend, against the CPU in float64.

    Args:
        device: "cuda", "mps", "cuda:1", "cpu", ...
        dtypes: the compute dtypes to check.
        backends: attention kernels (GPTConfig.attention_backend values).
        cfg: the model to check (default: 2 layers, 4 heads, width 64, 16 tokens, 512 ids).
        alter: called on each device model before it runs (a test plants a wrong
            operation with a forward hook, to prove the check finds it).

    Returns:
        The report: per dtype and backend, passed, or the first module (forward), gradient
        (backward) or parameter (optimizer step) beyond tolerance.

    Raises:
        ValueError: `device` is not a device here or holds no data (meta), or `dtypes` or
            `backends` is empty or names something that is not one.
    """
    device = usable_device(device)
    if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point
                             for d in dtypes):
        raise ValueError(f"dtypes must name one or more floating-point torch dtypes, got "
                         f"{dtypes!r}")
    if not backends:
        raise ValueError("no attention backend to check: name one or more of "
                         f"{', '.join(kernels.KERNELS)}")
    for backend in backends:
        if not kernels.is_backend_name(backend):
            raise ValueError(f"unknown attention backend {backend!r}: use "
                             f"{', '.join(kernels.KERNELS)} or 'package.module:ClassName'")
    cfg = cfg or GPTConfig(vocab_size=512, context_length=16, emb_dim=64, n_heads=4,
                           n_layers=2, drop_rate=0.0)
    versions = (f"torch {torch.__version__}, python {platform.python_version()}, "
                f"{platform.machine()}" + (f", CUDA {torch.version.cuda}"
                                           if device.type == "cuda" else ""))
    report = DeviceReport(str(device), versions)
    for dtype in dtypes:
        for backend in backends:
            report.cases.append(check_case(device, dtype, backend, cfg, alter=alter))
    return report


def usable_device(device: str | torch.device, name: str = "device") -> torch.device:
    """`device` as a torch.device that holds numbers here, or ValueError saying why not
    (`name`: how the message calls it, such as a command's flag)."""
    try:
        found = torch.device(device)
        torch.ones(1, device=found).cpu()  # meta has no data: copying out refuses
    except (RuntimeError, AssertionError, NotImplementedError, TypeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        hint = (": the meta device holds shapes, not numbers; check cpu, cuda or mps"
                if str(device).startswith("meta") else "")
        raise ValueError(f"{name} {device} is not available here ({first}; torch "
                         f"{torch.__version__}){hint}") from None
    return found
