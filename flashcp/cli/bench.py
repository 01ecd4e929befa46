"""``flashcp bench``: plan quality, planner speed, CPU runtime and projected step latency in one run."""

from __future__ import annotations

from pathlib import Path

import click

from flashcp.cli.console import console, info

__all__ = ["command"]


def _ints(value: str | None, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        numbers = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got '{value}'",
                                 param_hint=name) from None
    if not numbers or min(numbers) < 1:
        raise click.BadParameter(f"expected positive integers, got '{value}'", param_hint=name)
    return numbers


def _names(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


@click.command("bench")
@click.argument("data", required=False, type=click.Path(file_okay=False))
@click.option("--quick", is_flag=True, help="Small CI-sized run (well under 2 minutes on 2 CPU cores).")
@click.option("--scenario", "scenarios", metavar="LIST",
              help="Comma-separated subset of quality,speed,runtime,latency (default: these four; none with "
                   "--calibrate alone), or ring-cost (the ring baselines by the cost model) and dp (DP step "
                   "efficiency, stream order vs balanced), only when named.")
@click.option("--dist", "dists", metavar="LIST",
              help="Length distributions: wlb, prolong, pile or JSON files (default: all three, or only DATA "
                   "when DATA is given).")
@click.option("--cp", "cps", metavar="LIST", help="CP sizes (default 4,8).")
@click.option("--strategies", metavar="LIST",
              help="Strategies for plan quality, each NAME[@TARGET][:KEY=VALUE;...], e.g. "
                   "'flashcp+@1.05,flashcp2:effort=4' (default: every strategy).")
@click.option("--model", "model_name", metavar="NAME|CONFIG",
              help="The model priced: plan quality's flashcp2 plans for it and every plan is priced for one layer "
                   "of it; the dp scenario prices whole sequences of it. A built-in name or a Hugging Face "
                   "config.json [default: llama-3-8b].")
@click.option("--price-tokens", is_flag=True,
              help="Plan quality's step ms also prices the per-token layers (to compare token-slack plans).")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=None,
              help="Plan quality prices every plan with this many CP ranks per node (inter-node K/V at the "
                   "profile's inter_node_gbps) and shows intra- and inter-node receive [default: 0, one node].")
@click.option("--time-sequences", is_flag=True,
              help="Plan quality also plans every sequence alone and shows CPU ms per sequence (p50/p99/max).")
@click.option("--heads", metavar="LIST", help="Attention heads for the latency projection (default 16,32).")
@click.option("--context-len", type=click.IntRange(min=16), help="Context length of distributions "
              "(default 131072; DATA keeps its own).")
@click.option("--seqs", type=click.IntRange(min=1), help="Sequences per source (default 32, quick 4).")
@click.option("--speed-seqs", type=click.IntRange(min=1), help="Sequences timed per strategy for planner "
              "speed (default 64, quick 8).")
@click.option("--e2e-seqs", type=click.IntRange(min=0), help="Planner speed end to end: synthesise, plan and "
              "verify a lengths-only dataset of this many sequences (default 0: skip).")
@click.option("--e2e-strategies", metavar="LIST", help="Strategies planned end to end (default flashcp,flashcp+).")
@click.option("--workers", metavar="LIST", help="Worker counts of the end-to-end plan (default 1,2).")
@click.option("--runtime-context-len", type=click.IntRange(min=16),
              help="Context length of the CPU runtime scenario (default 8192, quick 4096).")
@click.option("--runtime-cp", type=click.IntRange(min=1),
              help="Gloo ranks of the CPU runtime scenario, at least 2 (default: one per core, 2 to 4).")
@click.option("--runtime-cases", metavar="LIST",
              help="STRATEGY/COMM cases of the CPU runtime scenario, e.g. 'llama3/full,ring/ring,perdoc/ring' "
                   "(default: the bench's systems with --quick, else every strategy with every comm mode).")
@click.option("--runtime-seqs", type=click.IntRange(min=1), help="Sequences of the CPU runtime scenario "
              "(default 2, quick 1).")
@click.option("--runtime-reps", type=click.IntRange(min=1), help="Timed steps per case of the CPU runtime "
              "scenario, after one warm-up (default 3, quick 1).")
@click.option("--runtime-heads", type=click.IntRange(min=1), help="Query heads of the CPU runtime scenario "
              "(default 4).")
@click.option("--runtime-kv-heads", type=click.IntRange(min=1), help="Key/value heads of the CPU runtime "
              "scenario (default: as many as query heads).")
@click.option("--runtime-head-dim", type=click.IntRange(min=1), help="Head dim of the CPU runtime scenario "
              "(default 32).")
@click.option("--dp", "dp_sizes", metavar="LIST", help="DP sizes of the dp scenario (default 8,32,128).")
@click.option("--balance-window", type=click.IntRange(min=0), help="Steps per balance window of the dp scenario "
              "(default 16; 0: stream order only).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the packed sequences.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="Hardware profile JSON (default: H100 SXM NVLink from public specs).")
@click.option("--calibrate", is_flag=True, help="Measure the attention curve and overheads on the GPU and "
              "write a profile (--profile-out), then use it.")
@click.option("--profile-out", type=click.Path(), help="Where --calibrate writes the profile "
              "(default bench/out/profile-<device>.json).")
@click.option("--measured", is_flag=True, help="Latency scenario with per-rank attention timed on the GPU "
              "(each rank in turn on one device); communication stays projected.")
@click.option("--measure-budget", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds of GPU timing for --measured; later settings are projected.")
@click.option("--device", default="cuda", show_default=True, help="Device for --calibrate / --measured.")
@click.option("--json", "json_path", type=click.Path(), help="Write every number to this file (a flashcp "
              "bench report there is replaced; anything else is refused).")
@click.option("--plot", "plot_path", type=click.Path(),
              help="Write the figure-style charts to this PNG.")
def command(data, quick, scenarios, dists, cps, strategies, model_name, price_tokens, gpus_per_node,
            time_sequences, heads, context_len, seqs, speed_seqs,
            e2e_seqs, e2e_strategies, workers,
            runtime_context_len, runtime_cp, runtime_cases, runtime_seqs, runtime_reps, runtime_heads,
            runtime_kv_heads, runtime_head_dim, dp_sizes, balance_window,
            seed, profile_path, calibrate, profile_out, measured, measure_budget,
            device, json_path, plot_path):
    """Compare CP strategies: plan quality, planner speed, CPU runtime and projected step latency (and ring-cost).

    DATA is a dataset folder (its sequences are benched instead of the default distributions). Latency
    numbers are PROJECTED from a hardware profile unless --measured times attention on a GPU.
    """
    from flashcp.errors import FlashcpError

    if data is not None and not Path(data).is_dir():
        raise FlashcpError(f"dataset folder {data} does not exist")
    from flashcp.bench.calibrate import PROFILE_OUTPUT
    from flashcp.bench.plots import BENCH_PLOT
    from flashcp.bench.report import print_report
    from flashcp.bench.suite import BENCH_REPORT, SCENARIOS, bench_config, run_bench
    from flashcp.costmodel.profile import load_profile
    from flashcp.outputs import check_output, write_json_output

    for path, kind in ((json_path, BENCH_REPORT), (plot_path, BENCH_PLOT), (profile_out, PROFILE_OUTPUT)):
        if path is not None:  # before any work (the default --profile-out is checked before calibrating)
            check_output(path, kind)

    chosen = _names(scenarios)
    if chosen is None:
        chosen = ("latency",) if measured else (() if calibrate else SCENARIOS)
    elif measured and "latency" not in chosen:
        chosen = (*chosen, "latency")
    if plot_path and "latency" not in chosen:
        raise click.BadParameter("--plot needs the latency scenario", param_hint="--plot")
    try:
        config = bench_config(quick=quick, data=data, dists=_names(dists), scenarios=chosen,
                              cps=_ints(cps, "--cp"), strategies=_names(strategies), model=model_name,
                              price_tokens=price_tokens or None, gpus_per_node=gpus_per_node,
                              time_sequences=time_sequences or None, heads=_ints(heads, "--heads"),
                              context_len=context_len,
                              num_seqs=seqs, speed_seqs=speed_seqs,
                              e2e_seqs=e2e_seqs, e2e_strategies=_names(e2e_strategies),
                              workers=_ints(workers, "--workers"), runtime_context_len=runtime_context_len,
                              runtime_cp=runtime_cp,
                              runtime_cases=_names(runtime_cases), runtime_seqs=runtime_seqs,
                              runtime_reps=runtime_reps, runtime_heads=runtime_heads,
                              runtime_kv_heads=runtime_kv_heads, runtime_head_dim=runtime_head_dim,
                              seed=seed, measured=measured, measure_budget_s=measure_budget, device=device,
                              dp_sizes=_ints(dp_sizes, "--dp"), balance_window=balance_window)
    except ValueError as e:
        raise FlashcpError(str(e)) from None
    profile = load_profile(profile_path)
    if calibrate:
        profile = _calibrate(profile, device, profile_out)
    if chosen:
        results = run_bench(config, profile, log=lambda m: info(m))
        print_report(results, console)
        if json_path:
            write_json_output(json_path, BENCH_REPORT, results)
            info(f"wrote {json_path}")
        if plot_path:
            from flashcp.bench.plots import write_plots

            write_plots(results, plot_path)
            info(f"wrote {plot_path}")


def _calibrate(profile, device_name: str, profile_out: str | None):
    import torch

    from flashcp.bench.calibrate import PROFILE_OUTPUT, calibrate_profile, save_profile
    from flashcp.bench.calibrate import device_name as name_of
    from flashcp.errors import FlashcpError
    from flashcp.outputs import check_output

    device = torch.device(device_name)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise FlashcpError(f"--calibrate measures a GPU, and '{device_name}' is not an available CUDA device")
    path = check_output(profile_out or f"bench/out/profile-{name_of(device).replace(' ', '-')}.json",
                        PROFILE_OUTPUT)
    info(f"calibrating on {name_of(device)}...")
    calibrated = calibrate_profile(profile, device)
    save_profile(calibrated, path)
    info(f"wrote {path}: " + ", ".join(f"{n}: {f:.0f}/{b:.0f}" for n, f, b in zip(
        calibrated.lengths, calibrated.forward_tflops, calibrated.backward_tflops)) + " TFLOP/s fwd/bwd; "
        f"kernel overhead {calibrated.kernel_overhead_us:.1f} us; copy {calibrated.hbm_gbps:.0f} GB/s")
    return calibrated
