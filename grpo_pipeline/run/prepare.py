"""prepare: train and eval prompt sets as Parquet, from the seeded generator or a user file."""

from __future__ import annotations

from grpo_pipeline import schemas
from grpo_pipeline.coding import add_task_columns, generate_tasks, load_tasks
from grpo_pipeline.config import DataConfig
from grpo_pipeline.data import generate_problems, load_problems, split_train_eval
from grpo_pipeline.run import summary


def run(cfg: DataConfig, *, train_out: str, eval_out: str, metrics_path: str | None = None) -> dict:
    if cfg.task == "coding" and cfg.source == "synthetic":
        df = generate_tasks(n=cfg.n_train + cfg.n_eval, seed=cfg.seed, families=cfg.coding_kinds, n_tests=cfg.n_tests)
    elif cfg.task == "coding":
        df = load_tasks(cfg.path, prompt_field=cfg.prompt_field, tests_field=cfg.tests_field,
                        entry_point_field=cfg.entry_point_field, reference_field=cfg.reference_field,
                        id_field=cfg.id_field, setup_field=cfg.setup_field)
    elif cfg.source == "synthetic":
        df = generate_problems(n=cfg.n_train + cfg.n_eval, seed=cfg.seed, languages=cfg.languages,
                               kinds=cfg.kinds, difficulty=cfg.difficulty)
    else:
        df = load_problems(cfg.path, question_field=cfg.question_field, answer_field=cfg.answer_field,
                           solution_field=cfg.solution_field, id_field=cfg.id_field)
    df = add_task_columns(df)  # null tests / entry_point for math prompts
    train, evald = split_train_eval(df, n_eval=cfg.n_eval, seed=cfg.seed)
    meta = {"data": cfg.model_dump()}
    schemas.write_table(train, train_out, "prompts", metadata=meta)
    schemas.write_table(evald, eval_out, "prompts", metadata=meta)
    metrics = {"train": train.height, "eval": evald.height,
               **{f"kind/{k}": n for k, n in df.group_by("kind").len().sort("kind").iter_rows()},
               **{f"language/{k}": n for k, n in df.group_by("language").len().sort("language").iter_rows()}}
    summary("prepare", metrics, path=metrics_path)
    return metrics
