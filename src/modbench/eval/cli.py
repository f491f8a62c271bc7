"""The ``modbench eval`` command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modbench.methods.options import MethodsFrom, use_plugins


def eval_command(
    run_dir: Annotated[Path | None, typer.Argument(
        help="A run folder written by `modbench train`.")] = None,
    probes: Annotated[bool, typer.Option(
        help="Run the offline probes (mqar, induction, cloze).")] = False,
    tasks: Annotated[list[str] | None, typer.Option(
        "--tasks", help="lm-evaluation-harness task, suite (climb12) or task YAML file; "
        "repeatable.")] = None,
    limit: Annotated[int | None, typer.Option(
        help="At most N items per probe/task (and N validation sequences).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Evaluation batch size.")] = None,
    num_fewshot: Annotated[int | None, typer.Option(
        help="Few-shot examples (default: each task's own).")] = None,
    list_suites: Annotated[bool, typer.Option(
        "--list-suites", help="List the named task suites and exit.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    trust_task_code: Annotated[bool, typer.Option(
        "--trust-task-code", help="Allow task YAML files (and what they include) to run "
        "code: Python (`!function`, an included .py, process_docs/results), metric and "
        "dataset scripts, templates reaching past the document (docs/reliability.md); only "
        "for task files you trust.")] = False,
    methods_from: MethodsFrom = None,
) -> None:
    """Evaluate a trained run: validation loss; with --probes the offline capability probes;
    with --tasks lm-evaluation-harness tasks, in process. Writes RUN_DIR/eval.json with
    per-item results.

    Example: modbench eval runs/t --probes --tasks my_task.yaml --limit 100
    """
    from modbench.errors import ModbenchError
    from modbench.eval.harness import SUITES

    if list_suites:
        for name, members in SUITES.items():
            typer.echo(f"{name}: {', '.join(members)}")
        return
    if run_dir is None:
        raise ModbenchError("give a run folder, e.g. `modbench eval runs/t --probes`")
    use_plugins(methods_from)
    from modbench.eval.harness import check_tasks, trusting_task_code
    from modbench.eval.run import check_run_folder, evaluate_run
    from modbench.runtime.lock import FolderLock

    check_run_folder(run_dir)  # before the lock: it must not create a missing folder
    check_tasks(tasks or [], trust_task_code)  # files and names, before any work
    with FolderLock(run_dir, "modbench eval"), trusting_task_code(trust_task_code):
        r = evaluate_run(run_dir, probes=probes, tasks=tasks, limit=limit,
                         batch_size=batch_size, num_fewshot=num_fewshot, progress=progress)
    v = r["validation"]
    typer.echo(f"run:        {run_dir} (step {r['step']})")
    if v["loss"] is not None:
        typer.echo(f"validation: loss {v['loss']:.4f} (ppl {v['ppl']:.1f}, "
                   f"{v['sequences']} sequences)")
    for name, t in r["tasks"].items():
        if "accuracy" in t:
            acc = "n/a" if t["accuracy"] is None else f"{t['accuracy']:.3f}"
            guess = (f"; guessing among the episode's values {t['guess']:.4f}"
                     if t.get("guess") is not None else "")
            typer.echo(f"{name + ':':<11} accuracy {acc} over {t['n']} items "
                       f"(chance {t['chance']:.4f}{guess})")
        else:
            val = "n/a" if t["score"] is None else f"{t['score']:.4f}"
            typer.echo(f"{name + ':':<11} {t['primary']} {val} over {t['n']} items")
    if "climb_avg" in r:
        typer.echo(f"climb_avg:  {r['climb_avg']:.4f}")
    typer.echo(f"wrote {Path(run_dir) / 'eval.json'}")


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `modbench train`.")],
    hf: Annotated[Path, typer.Option("--hf", help="Output folder of the Hugging Face "
                                     "checkpoint.")],
    push_to_hub: Annotated[str | None, typer.Option(
        "--push-to-hub", metavar="REPO", help="Then upload the folder to this Hugging Face "
        "Hub repo (created if missing), e.g. alice/modbench-qknorm; needs a token "
        "(`hf auth login` or HF_TOKEN).")] = None,
    private: Annotated[bool, typer.Option(
        help="With --push-to-hub: create the repo private.")] = False,
    methods_from: MethodsFrom = None,
) -> None:
    """Export a trained run as a self-contained Hugging Face checkpoint: config, weights
    (safetensors), tokenizer, model card (README.md) and the modbench model code it needs, so
    it loads with trust_remote_code=True where modbench is not installed.

    Example: modbench export runs/t --hf exported/t --push-to-hub alice/modbench-t
    """
    from modbench.eval.export import check_push, export_hf
    from modbench.runtime.lock import FolderLock

    use_plugins(methods_from)
    if push_to_hub is not None:
        check_push(push_to_hub)  # before any work: huggingface_hub, the repo id, a token
    with FolderLock(hf, "modbench export", beside=True):  # one writer of the --hf folder
        out = export_hf(run_dir, hf, repo_id=push_to_hub)
    typer.echo(f"wrote {out}")
    where = push_to_hub or str(out)
    if push_to_hub is not None:
        from modbench.eval.export import push_to_hub as push

        typer.echo(f"pushed {push(out, push_to_hub, private=private or None)}")
    typer.echo(f"load:  AutoModelForCausalLM.from_pretrained('{where}', trust_remote_code=True)")
    typer.echo(f"eval:  lm_eval --model hf --model_args pretrained={where},trust_remote_code=True "
               "--tasks ...")
