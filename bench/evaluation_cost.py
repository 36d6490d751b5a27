"""What the evaluation report and the model card (issue 37) add to a job: one BBC News job of
all-MiniLM-L6-v2 run end to end in-process (``worker.training.recipe.fine_tune``), with
``write_evaluation`` and ``write_model_card`` timed inside it (where ``worker.training.export`` calls
them). A subset keeps it short on a CPU; the report's share shrinks with more epochs (it runs once,
after training).

    python -m bench.evaluation_cost TRAIN_ROWS VALIDATION_ROWS EPOCHS MAX_LENGTH   # e.g. 360 40 1 256
"""

import argparse
import os
import sys
import tempfile
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("train_rows", "validation_rows", "epochs", "max_length"):
        parser.add_argument(name, type=int)
    args = parser.parse_args(argv)
    os.environ.update(TUNEJOB_DATA_DIR=tempfile.mkdtemp(), TUNEJOB_DEVICE="cpu", HF_HUB_OFFLINE="1")
    import torch

    import worker.training.export as export
    from bench.corpora import bbc_news
    from shared.schemas.jobs import JobCreate
    from shared.store.engine import upgrade_database
    from shared.store.rows import Job
    from worker.data import JobData
    from worker.reporter import MemoryReporter
    from worker.training.recipe import fine_tune

    train_n, val_n, epochs, max_length = args.train_rows, args.validation_rows, args.epochs, args.max_length
    df = bbc_news().sample(frac=1.0, random_state=0).reset_index(drop=True)
    train, val = df.iloc[:train_n].reset_index(drop=True), df.iloc[train_n : train_n + val_n].reset_index(drop=True)
    spent = {}

    def timing(name, f):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = f(*args, **kwargs)
            spent[name] = time.perf_counter() - start
            return result

        return timed

    for name in ("write_evaluation", "write_model_card"):
        setattr(export, name, timing(name, getattr(export, name)))
    upgrade_database()  # the store the artifact's training curves are read from
    spec = JobCreate(
        base_model="all-MiniLM-L6-v2",
        task="classification",
        training_dataset="ds_bench",
        hyperparameters={"epochs": epochs, "batch_size": 16, "max_length": max_length, "precision": "fp32"},
    )
    job = Job(
        id="job_benchevaluation",
        task="classification",
        base_model="all-MiniLM-L6-v2",
        label_names=sorted(df.label.unique()),
        spec=spec.model_dump(mode="json"),
    )
    start = time.perf_counter()
    fine_tune(job, JobData(train, val), torch.device("cpu"), MemoryReporter())
    total = time.perf_counter() - start
    print(
        f"train {train_n} validation {val_n} epochs {epochs} max_length {max_length} threads "
        f"{torch.get_num_threads()}: job {total:.1f} s, evaluation report {spent['write_evaluation']:.2f} s "
        f"({100 * spent['write_evaluation'] / total:.2f}%), model card {spent['write_model_card']:.3f} s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
