"""The parts of `train.py`, one concern each; imports only point down this list (no cycles):

    errors       TrainError, the one error a user can fix
    config       TrainConfig, every setting of a run, frozen once built
    lora         LoRA runs: trainable low-rank pairs in a frozen model, and out of it
    distributed  ranks under torchrun; parts run on rank 0 or on every rank
    state        train_state.pt and the served checkpoints on disk
    metrics      metrics.jsonl and loss.png
    args         the flags, parsed into a TrainConfig (with --resume, merged with the saved run)
    data         tokenized data, the split, the batch sampler
    chat_data    chat examples (OpenAI's fine-tuning JSONL): checked, rendered, masked
    setup        device, precision, the starting model, the --out check
    chat_batches chat examples in a run: rows, padded batches, the validation loss
    step         the optimizer, the LR schedule, one update, evaluation, a text sample
    loop         the run, top to bottom

`train.py` is the command line: `parse_config` then `loop.train`.
"""
