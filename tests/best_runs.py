"""The scripted dev metric of tests/test_best_checkpoint.py, for its runs in this process
and in children: the real evaluation runs, and its chrF is replaced by SCRIPT's value
for the evaluated step."""

# dev chrF by step: the best is 30 at step 6; 8, 10 and 12 (a tie) do not beat it, so
# patience 3 stops training at step 12, before the scripted 40 at 14.
SCRIPT = {2: 10.0, 4: 12.0, 6: 30.0, 8: 20.0, 10: 25.0, 12: 30.0, 14: 40.0, 16: 41.0}
OVERRIDES = dict(
    num_train_steps=16, eval_every_steps=2, checkpoint_every_steps=4, max_checkpoints_to_keep=2,
    early_stop_patience=3, eval_max_examples=2, final_eval_max_examples=2,
)  # fmt: skip


def scripted(real):
    """evaluate.evaluate with its eval_chrf replaced by SCRIPT's value for the state's step."""

    def evaluate_(state, *args, **kwargs):
        metrics, examples = real(state, *args, **kwargs)
        return {**metrics, "eval_chrf": SCRIPT.get(int(state.step), 0.0)}, examples

    return evaluate_
