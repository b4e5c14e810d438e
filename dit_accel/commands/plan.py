"""`dit-accel plan RUN`: from one profiled block, what each knob and each other GPU would give.

It reads a profile-block run folder (report.json: the measured kinds of work, this GPU's ceilings, the attention
calls and linears of the block) and predicts, with the models of `planning.predict`: every combination of FP8
attention, FP8 linears and torch.compile on this GPU (beside what the run measured of them), streaming under a
memory budget, context parallelism over several GPUs, step caching, and the baseline and the full recipe on
each GPU of the datasheet table. Every figure says whether it is measured, predicted from this run's
measurements, or scaled by datasheets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ..errors import UserError, first_line
from ..report_io import console, write_csv, write_json
from ..run_dir import DEFAULT_OUTPUT_ROOT, StagedRun, check_run_dir, default_run_name, read_run
from .options import AtLeast, FiniteFloat, MemorySize, OptionError


def precheck(run: Path, **_) -> None:
    """What is checked before torch loads (`cli.LazyCommand.precheck`): RUN is a profile-block run folder."""
    read_run(run)


class SkipRatio(FiniteFloat):
    """A fraction of passes skipped: 0 <= r < 1."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number >= 1:
            raise OptionError(f"must be below 1 (a fraction of the passes), got {value}", ctx=ctx, param=param)
        return number


@click.command("plan")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--gpu", "gpu_keys", default=None,
              help="GPUs of the datasheet table to predict for, comma-separated (default: all of them).")
@click.option("--memory-budget", type=MemorySize(), default=None,
              help="Predict streaming the blocks from host memory under this budget (e.g. 16GiB).")
@click.option("--host-link-gbps", type=FiniteFloat(1), default=None,
              help="Host-to-GPU GB/s for streaming (default: the pinned copy the run measured with its ceilings, "
                   "else the GPU's datasheet host link, per direction).")
@click.option("--gpus", type=AtLeast(1), default=1, show_default=True,
              help="Predict Ulysses context parallelism over this many GPUs.")
@click.option("--link-gbps", type=FiniteFloat(1), default=None,
              help="GPU-to-GPU GB/s per direction for --gpus (default: the datasheet NVLink figure).")
@click.option("--cache", "cache_text", metavar="METHOD[:PARAMS]", default=None,
              help="Predict a step cache, written as a recipe's cache= part, on the baseline and on the full recipe: "
                   "taylorseer[:interval][:warmup=V][:order=V] from its schedule (its computed steps counted as "
                   "diffusers runs them); fbc, mag and dbcache from the fraction of passes --cache-skip gives "
                   "(default fbc with --cache-skip alone); pab and faster from the fraction of their self-attention "
                   "forwards it gives.")
@click.option("--cache-skip", type=SkipRatio(0), default=None,
              help="The fraction a cache whose skips the weights or the pipeline's timesteps decide skips: of the "
                   "passes (fbc, mag, dbcache), of the self-attention forwards (pab, faster) (e.g. 0.4; a generate "
                   "run with it says: passes per step, and the work computed).")
@click.option("--cache-run", "cache_runs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="A dit-accel generate run of the block's video and steps on this GPU (repeatable): each of its "
                   "runs predicted, a cached one from its cache and the skip fraction it measured, from its "
                   "recipe's knobs, beside the transformer's time a pass that run measured.")
@click.option("--verify", is_flag=True,
              help="Run every knob combination this GPU can run on the run's block and inputs (profile-block with "
                   "the run's options, into a profile-block_verify folder of its own; with --memory-budget also the "
                   "whole transformer streamed: the baseline, our FP8 attention, the full recipe; with a --cache "
                   "whose skips the step count alone fixes, taylorseer, also the whole video under it, with the "
                   "baseline and the full recipe: profile-block --validate model --cache) and put measured beside "
                   "predicted.")
@click.option("--check", "check_evidence", is_flag=True,
              help="Also predict, from this run, each published measurement of attention and GEMM on other GPUs "
                   "(planning/data/measurements.json: source and quote each) and print it beside the published "
                   "figure with the error: how far the other-GPU rows' model carries.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for plan.json and plan.csv (default: outputs/plan_<run>_<time>).")
def plan(run, gpu_keys, memory_budget, host_link_gbps, gpus, link_gbps, cache_text, cache_skip, cache_runs, verify,
         check_evidence, out_dir):
    """Predict what each knob and each other GPU would give, from one profile-block run."""
    from ..attention.crossover import for_run
    from ..patching.step_cache import parse_cache
    from ..planning.cached import cache_plan
    from ..planning.gpus import datasheets, gpu_named, gpu_of_device
    from ..planning.measured import generate_runs, read_baseline, streamed_passes
    from ..planning.predict import Rates

    baseline = read_baseline(run)
    generated = [found for folder in cache_runs for found in generate_runs(folder, baseline)]
    cache = None
    if cache_text is not None or cache_skip is not None:
        cache = cache_plan(parse_cache(cache_text or "fbc"), baseline.steps, cache_skip)
    here = gpu_of_device(baseline.device_name)
    targets = [gpu_named(key.strip()) for key in gpu_keys.split(",")] if gpu_keys else list(datasheets()[1].values())
    measured_link = baseline.ceilings["host_link"]
    if here is None and ((memory_budget and host_link_gbps is None and measured_link is None)
                         or (gpus > 1 and link_gbps is None)):
        raise UserError(f"{baseline.device_name} is not in the datasheet table: pass --host-link-gbps (with "
                        "--memory-budget) and --link-gbps (with --gpus)")
    if gpus > 1 and link_gbps is None and here is not None and here.nvlink_gbps is None:
        raise UserError(f"{here.name} has no NVLink figure in the datasheet table; pass --link-gbps for --gpus {gpus}")
    staged = StagedRun(out_dir or DEFAULT_OUTPUT_ROOT / default_run_name("plan", run.resolve().name),
                       numbered=out_dir is None)
    if out_dir is not None:
        check_run_dir(out_dir)  # before --verify's runs, not after them
    verified_in, not_verified = [], []
    rates_from = run
    if verify:  # runs of their own (profile-block's folders, names and messages), the plan made from them
        verify_run = _verify_run(run, baseline, DEFAULT_OUTPUT_ROOT / default_run_name("profile-block", "verify"))
        verified, verified_in, rates_from = read_baseline(verify_run), [str(verify_run)], verify_run
        for label, why in read_run(verify_run).get("recipes_left_out", {}).items():
            not_verified.append(f"{label}: {why}")
            console.print(f"[yellow]note:[/yellow] --verify left {label} out: {why}")
        for recipe in _streamed_recipes(verified) if memory_budget is not None else ():
            try:
                stream_run = _verify_streaming(run, verified, recipe, memory_budget,
                                               DEFAULT_OUTPUT_ROOT / default_run_name("profile-block", "verify-stream"))
            except Exception as exc:  # noqa: BLE001 (the knobs' measurements stand; what failed is said)
                why = _why_it_failed(exc)
                not_verified.append(f"the streamed pass with {recipe} under {memory_budget.text}: {why}")
                console.print(f"[yellow]note:[/yellow] --verify could not stream the pass with {recipe}: {why}")
            else:
                verified.streamed += streamed_passes(read_run(stream_run), stream_run)
                verified_in.append(str(stream_run))
        if cache is not None:
            _verify_cache(run, verified, cache.spec, verified_in, not_verified)
        baseline = verified
    rates = Rates.of(baseline)
    crossover, crossover_note = for_run(rates_from, baseline.device_name)
    plan_data = build_plan(baseline, rates, (crossover, crossover_note), here, targets, memory_budget, host_link_gbps,
                           gpus, link_gbps, cache, generated)
    plan_data["verified_in"], plan_data["not_verified"] = verified_in, not_verified
    from ..planning.evidence import check, evidence_note

    checks = check(baseline, here)
    for row in plan_data["gpus"]:
        row["evidence"] = evidence_note(row["gpu"], checks) + (
            f"; thin: no published fraction for its {', '.join(row['thin_evidence'])}, the datasheet ratio alone"
            if row.get("thin_evidence") else "")
    if check_evidence:
        plan_data["evidence"] = [c.as_dict() for c in checks]
    with staged as folder:
        write_json(folder / "plan.json", plan_data)
        write_csv(folder / "plan.csv", [{"table": table, **row} for table in ("knobs", "gpus")
                                        for row in plan_data[table]])
    origin = measured_elsewhere(read_run(run))
    if origin:
        console.print(f"[yellow]note:[/yellow] {origin}")
    render(plan_data)
    if check_evidence:
        console.print(_evidence_table(checks, baseline.device_name))
    console.print(f"wrote {staged.final}/: plan.json, plan.csv")


def measured_elsewhere(report: dict[str, Any]) -> str | None:
    """One line saying a run was measured on another machine (a shipped example, a colleague's run): its GPU, host,
    date and commit; None for a run of this machine (same host name and platform, and its GPU here)."""
    import platform
    import socket

    import torch

    origin = report.get("provenance")
    if not origin:
        return None  # a report that does not say where it was made
    host = origin.get("host") or {}
    gpus_here = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    if (host.get("name") == socket.gethostname() and host.get("platform") == platform.platform()
            and report["device"]["name"] in gpus_here):
        return None
    git = origin.get("git") or {}
    code = f", dit-accel {git['commit'][:7]}{' with local changes' if git.get('dirty') else ''}" if git.get("commit") \
        else ""
    return (f"this run was measured on another machine ({report['device']['name']}, host {host.get('name')}, "
            f"{(origin.get('timestamp') or 'undated')[:10]}{code}): the plan scales what it measured there")


def _rerun_options(run: Path, baseline) -> list[str]:
    if baseline.rerun_options is None:
        raise UserError(f"{run}'s report predates --verify (no rerun_options); run profile-block again")
    return baseline.rerun_options


def _profile_again(run: Path, baseline, out: Path, recipes: list[str], **more) -> Path:
    """A profile-block session again on the run's block and inputs (its report's `rerun`: model, preset or
    checkpoint, block, workload, dtype, runs, seed; `rerun_options` for reports written before it), with `recipes`
    and `more` (validate, offload, memory budget, keep_going), into `out`, through the library profile-block runs
    on (`profiling.request`); the folder it wrote."""
    import torch

    from ..patching.recipe import parse_recipe
    from ..profiling.memory import check_fits
    from ..profiling.progress import NO_PROGRESS
    from ..profiling.request import ProfileRequest, profile_settings, run_profile

    report = read_run(run)
    fields = {"recipes": tuple(parse_recipe(name) for name in recipes), **more}
    if report.get("outside") and "outside_ms" not in more:  # the run measured outside the blocks: so does this one
        fields["outside_mode"] = "measure"
    request = (ProfileRequest.from_rerun(report["rerun"], **fields) if report.get("rerun")
               else ProfileRequest.from_rerun_options(_rerun_options(run, baseline), **fields))
    options = {"outside_mode": "outside"}  # the request's fields by the command's option names where they differ
    shown = {"memory_budget": lambda v: v[0], "cache": lambda v: v.written}
    console.print(f"[dim]--verify: profile-block {' '.join(request.rerun_options(request.dtype))} "
                  f"--compare-attn {','.join(recipes)}"
                  + "".join(f" --{options.get(k, k).replace('_', '-')}={shown.get(k, str)(v)}"
                            for k, v in fields.items() if k not in ("recipes", "keep_going"))
                  + ("  --keep-going" if more.get("keep_going") else "") + f" (into {out})[/dim]")
    settings = profile_settings(request)
    budget = request.memory_budget
    estimate = check_fits(settings, budget[1] if budget else None, budget[0] if budget else None)
    staged = StagedRun(out, numbered=True)
    try:
        with console.status(f"--verify: profiling {settings.adapter.display_name}'s block with {len(recipes)} "
                            f"recipe(s)"), staged as run_dir:
            profiled = run_profile(settings, run_dir, NO_PROGRESS, estimate=estimate,
                                   memory_budget_bytes=budget[1] if budget else None,
                                   on_note=lambda note: console.print(f"[yellow]note:[/yellow] {note}"))
    except torch.OutOfMemoryError as exc:
        raise UserError(f"--verify ran out of {'the ' + budget[0] + ' budget' if budget else 'GPU memory'} profiling "
                        f"the block again; plan without --verify, or with a larger --memory-budget") from exc
    for note in profiled.result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    return staged.final


def _verify_run(run: Path, baseline, out: Path) -> Path:
    """The run's block and inputs again with the baseline's attention and every knob combination this GPU can run
    side by side, into `out`."""
    import torch

    from ..planning.knobs import recipe_of
    from ..planning.predict import knob_sets

    if not torch.cuda.is_available():
        raise UserError("--verify runs the knobs on this machine's GPU, and it has none; plan without --verify here")
    recipes = [name for name in (recipe_of(knobs, baseline.attention_backend) for knobs in knob_sets())
               if _runs_here(name, baseline, f"--verify leaves {name} out")]
    return _profile_again(run, baseline, out, recipes, keep_going=True)


def _runs_here(name: str, baseline, skipped: str) -> bool:
    """Whether this GPU runs recipe `name` in the baseline's dtype; if not, a note: `skipped` and why."""
    import torch

    from ..patching.recipe import check_recipes, parse_recipe

    try:
        check_recipes([parse_recipe(name)], torch.device("cuda"), getattr(torch, baseline.dtype))
    except UserError as exc:
        console.print(f"[yellow]note:[/yellow] {skipped}: {exc}")
        return False
    return True


def _why_it_failed(exc: BaseException) -> str:
    """A --verify run that failed, for its note: a UserError's line (e.g. the block and its profiling do not fit the
    budget), or anything else as a failure of the stack under the recipe (as diffusers' offloading of Allegro's FP8
    weights once compiled was under torch 2.11, until 1e62459), named by its type and first line."""
    return str(exc) if isinstance(exc, UserError) else f"failed ({type(exc).__name__}: {first_line(exc)})"


def _verify_cache(run: Path, verified, spec, verified_in: list[str], not_verified: list[str]) -> None:
    """The whole video under the step cache `spec` with the baseline and with the full recipe (profile-block
    --validate model --cache), each into a profile-block_verify-cache folder, into `verified.cached_videos`; a cache
    that needs a pipeline, or a video that fails, is a note and a `not_verified` line."""
    from ..patching.step_cache import CACHE_METHODS
    from ..planning.knobs import recipe_of
    from ..planning.measured import cached_videos
    from ..planning.predict import ALL_KNOBS

    method = CACHE_METHODS[spec.method]
    if not method.runs_on_a_model:
        by = "the pipeline's timesteps" if method.needs_timestep else "a threshold"
        why = f"{method.title} skips by {by}: measure it with generate --attn RECIPE+{spec.label}"
        not_verified.append(f"{spec.label}: {why}")
        console.print(f"[yellow]note:[/yellow] --verify runs no video under {spec.label}: {why}")
        return
    for knobs in (frozenset(), ALL_KNOBS):
        recipe = recipe_of(knobs, verified.attention_backend)
        if not _runs_here(recipe, verified, f"--verify runs no video under {spec.label} with {recipe}"):
            continue
        try:
            video_run = _profile_again(run, verified, DEFAULT_OUTPUT_ROOT / default_run_name("profile-block",
                                                                                             "verify-cache"),
                                       [recipe], validate="model", cache=spec)
        except Exception as exc:  # noqa: BLE001 (the knobs' measurements stand; what failed is said)
            why = _why_it_failed(exc)
            not_verified.append(f"the video under {spec.label} with {recipe}: {why}")
            console.print(f"[yellow]note:[/yellow] --verify could not run the video under {spec.label} with "
                          f"{recipe}: {why}")
        else:
            verified.cached_videos += cached_videos(read_run(video_run), video_run)
            verified_in.append(str(video_run))


def _streamed_recipes(baseline) -> list[str]:
    """The recipes --verify streams the whole transformer with, those this GPU runs of the streaming rows'
    (`predict.streamed_knob_sets`): the baseline, our FP8 attention alone, the full recipe."""
    from ..planning.knobs import recipe_of
    from ..planning.predict import streamed_knob_sets

    return [name for name in (recipe_of(knobs, baseline.attention_backend) for knobs in streamed_knob_sets())
            if _runs_here(name, baseline, f"--verify streams no pass with {name}")]


def _verify_streaming(run: Path, baseline, recipe: str, budget, out: Path) -> Path:
    """The whole transformer with its blocks streamed under `budget`, under `recipe` (what profile-block --validate
    model --offload stream measures of its first recipe), into `out`."""
    return _profile_again(run, baseline, out, [recipe], validate="model", offload="stream",
                          memory_budget=(budget.text, budget.nbytes))


def build_plan(baseline, rates, routing, here, targets, memory_budget, host_link_gbps, gpus, link_gbps,
               cache=None, generated=()) -> dict[str, Any]:
    """The plan's content. routing: (the crossover data our kernel's rates come from, None without any; the line
    saying which, `crossover.for_run`); cache: a `planning.cached.CachePlan` to predict, or None; generated: the
    runs of generate runs to predict beside what they measured (`measured.generate_runs`)."""
    from ..planning.gpus import datasheets
    from ..planning.knobs import KNOB_NAMES
    from ..planning.predict import (ALL_KNOBS, ASSUMPTIONS, FP8_ATTENTION_ESTIMATE, GIB, KNOB_MODELS, fits, knob_sets,
                                    on_other_gpu, predict_block, pass_ms_of, resident_bytes, streamed_bytes,
                                    streamed_pass_ms, thin_evidence, video_seconds)

    crossover, crossover_note = routing
    measured = {m.knobs: m for m in baseline.measured}
    models = {**KNOB_MODELS, **({} if crossover is not None else {"fp8-attention": FP8_ATTENTION_ESTIMATE})}
    predicted = {knobs: {s.stack: predict_block(s, baseline, knobs, rates, crossover) for s in baseline.stacks}
                 for knobs in knob_sets()}
    knobs_rows, sets = [], {}
    for knobs, blocks in predicted.items():
        pass_ms = pass_ms_of(baseline, {stack: block.ms for stack, block in blocks.items()})
        memory = resident_bytes(baseline, knobs)
        row = {"knobs": knobs_label(knobs), "gpu": baseline.device_name,
               "block_ms": {s: round(b.ms, 2) for s, b in blocks.items()}, "pass_ms": round(pass_ms, 1),
               "video_s": round(video_seconds(baseline, pass_ms), 1), "memory_gib": round(memory / GIB, 2),
               "fits": fits(baseline, knobs, baseline.device_memory_gib * GIB),
               "basis": "measured" if not knobs else "predicted from this run" + (
                   "; FP8 attention estimated" if "fp8-attention" in knobs and crossover is None else ""),
               "parts_ms": {s: {k: round(v, 2) for k, v in b.parts.items()} for s, b in blocks.items()},
               "model": "; ".join(models[k] for k in sorted(knobs)) or f"measured: {baseline.recipe}"}
        if knobs in measured and knobs:
            m = measured[knobs]
            row["measured"] = {"recipe": m.label, "block_ms": m.block_ms, "attention_rel_err": m.attention_rel_err,
                               "output_rel_l2": m.output_rel_l2,
                               "difference_pct": {s: round(100 * (blocks[s].ms / ms - 1), 1)
                                                  for s, ms in m.block_ms.items() if s in blocks}}
        knobs_rows.append(row)
        sets[knobs] = ({stack: block.ms for stack, block in blocks.items()}, pass_ms)
    knobs_rows += _scaling_rows(baseline, here, rates, sets, memory_budget, host_link_gbps, gpus, link_gbps)
    if cache is not None:
        knobs_rows += _cache_rows(baseline, cache, predicted, rates)
    knobs_rows += _generated_rows(baseline, generated, predicted, rates)

    gpu_rows = []
    for target in targets:
        for knobs in (frozenset(), ALL_KNOBS):
            blocks = predicted[knobs]
            row = {"gpu": target.key, "name": target.name, "knobs": knobs_label(knobs),
                   "basis": "datasheet-scaled from this run"}
            if here is None:
                row["note"] = f"{baseline.device_name} is not in the datasheet table: nothing to scale from"
                gpu_rows.append(row)
                continue
            scaled = {s: on_other_gpu(b, here, target) for s, b in blocks.items()}
            missing = next((why for ms, why in scaled.values() if ms is None), None)
            if missing:
                row["note"] = missing
                gpu_rows.append(row)
                continue
            thin = sorted({kind for b in blocks.values() for kind in thin_evidence(b, here, target)})
            if thin:
                row["thin_evidence"] = thin
            memory = resident_bytes(baseline, knobs)
            where = fits(baseline, knobs, target.memory_gb * 1e9)
            block_ms = {s: ms for s, (ms, _) in scaled.items()}
            pass_ms = pass_ms_of(baseline, block_ms)
            link = rates.host_link_there(here, target)
            if where == "streamed":
                pass_ms = streamed_pass_ms(baseline, knobs, block_ms, link)
                memory = streamed_bytes(baseline, knobs)
            row.update({"block_ms": {s: round(v, 2) for s, v in block_ms.items()}, "pass_ms": round(pass_ms, 1),
                        "video_s": round(video_seconds(baseline, pass_ms), 1) if where != "no" else None,
                        "memory_gib": round(memory / GIB, 2), "fits": where,
                        "note": {"model": "", "no": "neither the model nor two blocks fit",
                                 "streamed": f"blocks streamed over {target.host_link} ({link:.4g} GB/s)"}[where]})
            gpu_rows.append(row)
    ranking = sorted((row for row in knobs_rows if row["knobs"] in KNOB_NAMES),
                     key=lambda row: row["video_s"])
    return {
        "run": str(baseline.run_dir), "device": baseline.device_name, "baseline_recipe": baseline.recipe,
        "rates_here": {"bf16_gemm_tflops": rates.bf16, "fp8_gemm_tflops": rates.fp8, "copy_gbps": rates.copy,
                       "gemm_efficiency": rates.gemm_efficiency, "memory_efficiency": rates.memory_efficiency,
                       "host_link_gbps": rates.host_link},
        "crossover": crossover_note, "fp8_attention_estimated": crossover is None,
        "video": {"steps": baseline.steps, "passes_per_step": baseline.passes, "outside_ms": baseline.outside_ms,
                  "outside_source": baseline.outside_source},
        "knobs": knobs_rows, "gpus": gpu_rows,
        "ranking": [{"knob": row["knobs"], "video_s": row["video_s"], **_error_of(row["knobs"], baseline)}
                    for row in ranking],
        "assumptions": list(ASSUMPTIONS),
        "datasheet_conventions": list(datasheets()[0]),
        "datasheet_here": here.key if here else None,
    }


def knobs_label(knobs: frozenset) -> str:
    """A knob set as the plan's rows name it: its knobs sorted, joined by " + ", or "baseline"."""
    return " + ".join(sorted(knobs)) or "baseline"


def _error_of(knob: str, baseline) -> dict[str, Any]:
    """The errors the run measured with `knob` alone, else with the smallest recipe that turns it (said so)."""
    runs = sorted((m for m in baseline.measured if knob in m.knobs), key=lambda m: len(m.knobs))
    if not runs:
        return {"error": "not measured in this run"}
    m = runs[0]
    alone = m.knobs == {knob}
    return {"error_from": m.label if alone else f"{m.label} (not alone)", "attention_rel_err": m.attention_rel_err,
            "output_rel_l2": m.output_rel_l2}


def _stream_row(baseline, knobs: frozenset, block_ms: dict[str, float], pass_ms: float, budget,
                link: float) -> dict[str, Any]:
    """A recipe with its blocks streamed from host memory under `budget` (fits: "model" where the whole model also fits
    resident, at the pass of its knob row, `pass_ms`), beside the streamed pass a run measured with the same knobs
    and budget (--verify, or --validate model --offload stream), if one did: its time and its peak memory."""
    from ..planning.knobs import knobs_of
    from ..planning.predict import GIB, fits, streamed_bytes, streamed_pass_ms, video_seconds

    name = knobs_label(knobs)
    where = fits(baseline, knobs, budget.nbytes)
    predicted = streamed_pass_ms(baseline, knobs, block_ms, link)
    model = f"each block the longer of its compute and its copy at {link:.4g} GB/s, the first copy not hidden"
    if where == "model":
        model += f"; the model also fits resident ({pass_ms:.0f} ms a pass, its knob row)"
    row = {"knobs": f"{name} + stream under {budget.text}", "gpu": baseline.device_name,
           "pass_ms": round(predicted, 1), "video_s": round(video_seconds(baseline, predicted), 1) if where != "no"
           else None, "memory_gib": round(streamed_bytes(baseline, knobs) / GIB, 2), "fits": where,
           "basis": "predicted from this run", "model": model}
    streamed = next((p for p in baseline.streamed if p["budget"] == budget.text and knobs_of(p["recipe"]) == knobs),
                    None)
    if streamed:
        row["measured"] = {"recipe": f"{streamed['recipe']}, --validate model --offload stream", "run": streamed["run"],
                           "pass_ms": round(streamed["pass_ms"], 1), "h2d_gbps": round(streamed["h2d_gbps"], 1),
                           "difference_pct": {"pass": round(100 * (predicted / streamed["pass_ms"] - 1), 1)}}
        if streamed["peak_bytes"]:
            row["measured"]["peak_gib"] = round(streamed["peak_bytes"] / GIB, 2)
    return row


def _cache_rows(baseline, cache, predicted, rates) -> list[dict]:
    """The step cache `cache` (`planning.cached.CachePlan`) on the baseline and on the full recipe. predicted: knob
    set -> its blocks (`BlockPrediction` by stack)."""
    from ..planning.knobs import knobs_of
    from ..planning.predict import ALL_KNOBS

    rows = []
    for knobs in (frozenset(), ALL_KNOBS):
        row = _cache_row(baseline, cache, knobs, predicted[knobs], rates)
        video = next((v for v in baseline.cached_videos
                      if v["cache"] == cache.label and knobs_of(v["recipe"]) == knobs), None)
        if video:
            row["measured"] = _measured_pass(row["pass_ms"], video, f"{video['recipe']}, --validate model --cache "
                                                                     f"{cache.spec.written}")
            row["measured"]["work_computed"] = round(video["work_computed"], 4)
        rows.append(row)
    return rows


def _generated_rows(baseline, generated, predicted, rates) -> list[dict]:
    """Each generate run's prediction (`measured.generate_runs`) beside what it measured: a cached run from its
    cache and the skip fraction it measured (TaylorSeer from its schedule), an uncached one the recipe's pass; a
    recipe plan has no knob set for (say fa4) gets a row saying so."""
    from ..patching.step_cache import parse_cache
    from ..planning.cached import cache_plan, cache_skip_measured
    from ..planning.knobs import knobs_of
    from ..planning.predict import pass_ms_of, video_seconds

    rows = []
    for found in generated:
        knobs, summary = knobs_of(found["recipe"]), found["cache"]
        what = f"{found['label']}, generate"
        spec = summary and parse_cache(summary["cache"].removeprefix("cache="))
        skip = summary and (0.0 if spec.calibrate else cache_skip_measured(summary))  # a calibration skips nothing
        why = (f"{found['recipe']} is no knob set plan predicts" if knobs not in predicted else
               "its report has no per-step counts of what the cache ran" if summary and skip is None
               and spec.method != "taylorseer" else None)
        if why:
            rows.append({"knobs": found["label"], "gpu": baseline.device_name, "basis": "not predicted",
                         "model": why, "measured": {"recipe": what, "run": found["run"],
                                                    "pass_ms": round(found["pass_ms"], 1)}})
            continue
        if summary is None:
            pass_ms = pass_ms_of(baseline, {stack: block.ms for stack, block in predicted[knobs].items()})
            row = {"knobs": f"{knobs_label(knobs)} (whole video)", "gpu": baseline.device_name,
                   "pass_ms": round(pass_ms, 1), "video_s": round(video_seconds(baseline, pass_ms), 1),
                   "basis": "predicted from this run", "model": "the block's pass, no cache"}
        else:
            row = _cache_row(baseline, cache_plan(spec, baseline.steps, skip), knobs, predicted[knobs], rates)
        row["measured"] = _measured_pass(row["pass_ms"], found, what)
        rows.append(row)
    return rows


def _measured_pass(predicted_ms: float, measured: dict, recipe: str) -> dict:
    """A row's measured pass (averaged over a whole video) and the prediction's difference from it."""
    return {"recipe": recipe, "run": measured["run"], "pass_ms": round(measured["pass_ms"], 1),
            "graphs_compiled": measured["graphs_compiled"],
            "difference_pct": {"pass": round(100 * (predicted_ms / measured["pass_ms"] - 1), 1)}}


def _cache_row(baseline, cache, knobs, blocks, rates) -> dict:
    """The row of the step cache `cache` on the knob set `knobs`, from its predicted `blocks` (by stack)."""
    from ..planning.cached import cached_pass_ms, kept_blocks
    from ..planning.predict import video_seconds

    kept = kept_blocks(cache.spec) if cache.saves == "passes" else 0
    model = {"passes": "a skipped pass runs the outside of the blocks" + (
        f" and the {kept} block(s) the cache always computes" if kept else ""),
             "attention": "a predicted step skips the attention modules (self and cross) of every block and writes "
                          "their Taylor series' outputs (eager elementwise work); graph breaks not modelled",
             "self-attention": "a skipped forward of a self-attention module " + (
                 "extrapolates its last two outputs (eager elementwise work)" if cache.spec.method == "faster"
                 else "returns its last output") + "; graph breaks not modelled"}
    pass_ms = cached_pass_ms(baseline, cache, blocks, knobs, rates)
    return {"knobs": f"{knobs_label(knobs)} + {cache.label}", "gpu": baseline.device_name,
            "pass_ms": round(pass_ms, 1), "video_s": round(video_seconds(baseline, pass_ms), 1),
            "basis": "predicted from this run",
            "model": f"{cache.source} ({cache.skipped:.0%} skipped); {model[cache.saves]}"}


def _scaling_rows(baseline, here, rates, sets, memory_budget, host_link_gbps, gpus, link_gbps) -> list[dict]:
    """Streaming of the baseline, of our FP8 attention alone and of the full recipe (what --verify streams too);
    context parallelism on top of the full recipe. sets: knob set -> (block ms by stack, pass ms)."""
    from ..planning.predict import ALL_KNOBS, context_parallel_pass_ms, streamed_knob_sets, video_seconds

    block_ms, _ = sets[ALL_KNOBS]
    name = knobs_label(ALL_KNOBS)
    rows = []
    if memory_budget is not None:
        link = host_link_gbps or rates.host_link_there(here)  # the flag, else what was measured, else the datasheet
        for streamed in streamed_knob_sets():
            streamed_blocks, streamed_pass = sets[streamed]
            rows.append(_stream_row(baseline, streamed, streamed_blocks, streamed_pass, memory_budget, link))
    if gpus > 1:
        link = link_gbps or here.nvlink_gbps
        parallel, why = context_parallel_pass_ms(baseline, block_ms, gpus, link)
        rows.append({"knobs": f"{name} + Ulysses over {gpus} GPUs", "gpu": baseline.device_name,
                     "pass_ms": round(parallel, 1) if parallel else None,
                     "video_s": round(video_seconds(baseline, parallel), 1) if parallel else None,
                     "basis": "predicted from this run", "note": why,
                     "model": f"block work / {gpus} plus 4 all-to-alls per attention call at {link:g} GB/s, "
                              f"not overlapped"})
    return rows


def render(plan_data: dict[str, Any]) -> None:
    from ..planning.predict import FP8_ATTENTION_ESTIMATE

    table = Table(title=f"What each knob would give on {plan_data['device']} (baseline: "
                        f"{plan_data['baseline_recipe']}, measured)")
    for column in ("knobs", "block ms", "measured", "diff", "video", "memory", "fits", "basis"):
        table.add_column(column, justify="left" if column in ("knobs", "basis", "fits") else "right")
    for row in plan_data["knobs"]:
        measured = row.get("measured", {})
        blocks = row.get("block_ms", {})
        table.add_row(row["knobs"], " / ".join(f"{v:.2f}" for v in blocks.values()) or _pass(row.get("pass_ms")),
                      " / ".join(f"{v:.2f}" for v in measured.get("block_ms", {}).values())
                      or _pass(measured.get("pass_ms")),
                      " / ".join(f"{v:+.1f}%" for v in measured.get("difference_pct", {}).values()) or "—",
                      _minutes(row.get("video_s")), _memory(row), row.get("fits", "—"), row["basis"])
    console.print(table)
    console.print(f"[yellow]FP8 attention {FP8_ATTENTION_ESTIMATE}[/yellow]" if plan_data["fp8_attention_estimated"]
                  else f"[dim]FP8 attention: {plan_data['crossover']}[/dim]")
    gpus = Table(title="Other GPUs (scaled from this run: compute by the datasheet's tensor rate and the published "
                       "fraction of it its class reaches, memory-bound work by bandwidth)")
    for column in ("GPU", "knobs", "block ms", "video", "memory", "fits", "note", "published evidence (--check)"):
        gpus.add_column(column)
    shown = set()
    for row in plan_data["gpus"]:
        evidence = row.get("evidence", "") if row["gpu"] not in shown else ""
        shown.add(row["gpu"])
        gpus.add_row(row["gpu"], row["knobs"], " / ".join(f"{v:.2f}" for v in row.get("block_ms", {}).values()) or "—",
                     _minutes(row.get("video_s")), f"{row['memory_gib']:.1f} GiB" if "memory_gib" in row else "—",
                     row.get("fits", "—"), row.get("note", ""), evidence)
    console.print(gpus)
    for entry in plan_data["ranking"]:
        error = (f"error measured with {entry['error_from']}: attention {entry['attention_rel_err']:.2%}, block "
                 f"output {entry['output_rel_l2']:.2%}" if "error_from" in entry and entry["attention_rel_err"]
                 is not None and entry["output_rel_l2"] is not None else entry.get("error", "error not measured"))
        console.print(f"  {entry['knob']}: {_minutes(entry['video_s'])} a video; {error}")
    for line in plan_data["assumptions"]:
        console.print(f"[dim]assumes: {line}[/dim]")


def _evidence_table(checks, device_name: str) -> Table:
    table = Table(title=f"Published measurements beside the model's prediction from this run ({device_name}): "
                        f"TFLOP/s (attention share: % of the block); error of the predicted time")
    # its id in the shipped list (GPU, kind, number), whole: the name plan.json and measurements.json give it
    table.add_column("measurement", no_wrap=True, min_width=max((len(c.measurement.id) for c in checks), default=0))
    table.add_column("precision", max_width=24)
    table.add_column("what ran", no_wrap=True, overflow="ellipsis", max_width=34)  # whole in plan.json
    table.add_column("shape")
    for column in ("published", "predicted", "error"):
        table.add_column(column, justify="right")
    for c in checks:
        m = c.measurement
        error = "—" if c.error is None else (f"{c.error:+.1f} pt" if m.kind == "attention_share" else f"{c.error:+.0%}")
        error += " (basis)" if c.basis else ""
        table.add_row(m.id, m.dtype, m.what_ran, m.label,
                      "—" if c.published is None else f"{c.published:.4g}",
                      "—" if c.predicted is None else f"{c.predicted:.4g}", error if c.why_none is None else c.why_none)
    return table


def _memory(row: dict[str, Any]) -> str:
    """A knob row's predicted memory, and a streamed pass's measured peak beside it where one was measured."""
    if "memory_gib" not in row:
        return "—"
    peak = row.get("measured", {}).get("peak_gib")
    return f"{row['memory_gib']:.1f} GiB" + (f" (peak {peak:.1f})" if peak else "")


def _pass(ms: float | None) -> str:
    return "—" if ms is None else f"pass {ms:.0f}"


def _minutes(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f} min"
