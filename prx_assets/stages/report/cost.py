"""What 1,000 images cost at the throughput a stage run measured.

Wall seconds per 1,000 rows, times the devices the stage held (GPUs, or one CPU machine
when it used none), times a price per device-hour. The prices are configuration (the
captioner and classifier resources); the defaults are assumptions, not quotes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Assumed on-demand price of one H200 GPU-hour (USD), in the range cloud providers listed
# in 2025; set `gpu_hour_usd` on the resource to your own.
DEFAULT_GPU_HOUR_USD = 3.50
# Assumed price of the CPU machine a GPU-less stage runs on (an ~8-vCPU instance-hour).
DEFAULT_CPU_HOUR_USD = 0.40


@dataclass(frozen=True)
class CostPer1000:
    seconds: float  # wall time per 1,000 rows
    device_hours: float  # GPU-hours (or CPU machine-hours) per 1,000 rows
    devices: float
    device: str  # "GPU" or "CPU machine"
    usd: float
    price_per_hour: float


def cost_per_1000(seconds: float, rows: int, gpus: float, gpu_hour_usd: float,
                  cpu_hour_usd: float) -> CostPer1000 | None:
    """None when the run processed nothing (or took no time): there is no rate to scale."""
    if rows <= 0 or seconds <= 0:
        return None
    per_1000 = seconds / rows * 1000
    devices, device, price = (gpus, "GPU", gpu_hour_usd) if gpus > 0 \
        else (1.0, "CPU machine", cpu_hour_usd)
    hours = per_1000 / 3600 * devices
    return CostPer1000(seconds=per_1000, device_hours=hours, devices=devices, device=device,
                       usd=hours * price, price_per_hour=price)


def cost_markdown(cost: CostPer1000) -> str:
    """One line: "**12.0 s** per 1,000 images on 1 GPU = 0.0033 GPU-hours ≈ **$0.0117**
    (at $3.50 per GPU-hour)"."""
    devices = f"{cost.devices:g} {cost.device}{'s' if cost.devices != 1 else ''}"
    return (f"**{cost.seconds:,.1f} s** per 1,000 images on {devices} = "
            f"{cost.device_hours:.4f} {cost.device}-hours ≈ **${cost.usd:,.4f}** "
            f"(at ${cost.price_per_hour:,.2f} per {cost.device}-hour)")
