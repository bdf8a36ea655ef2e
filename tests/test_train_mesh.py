"""Sharded training on 8 fake CPU devices: every mesh gives the losses of one device,
and a checkpoint written on one mesh restores onto another.

The body runs in a subprocess because the device count must be set before JAX
is imported, and the rest of the suite assumes one device.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from tests.conftest import small_train_config
    from tests.training import reverse_batch
    from attention_jax.training import checkpoints, steps
    from attention_jax.training.mesh import make_mesh, shard_batch

    assert jax.device_count() == 8, jax.devices()
    workdir = sys.argv[1]
    rng = np.random.default_rng(0)
    batches = [reverse_batch(rng, 16, 12, 64) for _ in range(4)]

    def run(shape, devices, save=False):
        cfg = small_train_config(vocab_size=64, grad_clip_norm=1.0)
        cfg.model.d_model, cfg.model.num_heads, cfg.model.d_ff = 32, 4, 64
        cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor = shape
        mesh = make_mesh(cfg, devices)
        setup = steps.train_setup(cfg, mesh)
        state = steps.init_train_state(setup)
        train_step = steps.make_train_step(setup)
        eval_step = steps.make_eval_step(setup)

        def fixed_loss(state):  # batches[0] without dropout: the same batch, the same net
            sums = eval_step(state.params, state.rngs, shard_batch(batches[0], mesh))
            return float(steps.summarize(sums)["loss"])

        before = fixed_loss(state)
        losses = []
        for b in batches:
            state, m = train_step(state, shard_batch(b, mesh))
            losses.append(float(m["loss"]))
        out = {"losses": losses, "fixed_loss": [before, fixed_loss(state)]}
        wq = state.params["encoder_layers"][0]["self_attn"]["query"][...]
        out["query_spec"] = list(wq.sharding.spec)
        if save:
            manager = checkpoints.Checkpoints(workdir)
            manager.save(state, {"iterators": []})
            manager.wait()
            manager.close()
            out["params"] = [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)[:3]]
            # Restore the (2, 2, 2) checkpoint onto a single-device mesh.
            cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor = 1, 1, 1
            mesh1 = make_mesh(cfg, jax.devices()[:1])
            setup1 = steps.train_setup(cfg, mesh1)
            manager = checkpoints.Checkpoints(workdir)
            restored, _ = manager.restore(manager.latest_step(), setup1.abstract)
            manager.close()
            leaves = jax.tree.leaves(restored.params)
            out["restored_params"] = [np.asarray(x).tolist() for x in leaves[:3]]
            out["restored_devices"] = sorted({len(x.devices()) for x in leaves})
            # ... and keep training on one device: same next loss as on 8.
            step1 = steps.make_train_step(setup1)
            _, m1 = step1(restored, shard_batch(batches[0], mesh1))
            _, m8 = train_step(state, shard_batch(batches[0], mesh))
            out["next_loss"] = [float(m1["loss"]), float(m8["loss"])]
        return out

    results = {
        "1": run((1, 1, 1), jax.devices()[:1]),
        "8,1,1": run((8, 1, 1), None),
        "2,4,1": run((2, 4, 1), None),
        "2,2,2": run((2, 2, 2), None, save=True),
    }
    print("RESULT " + json.dumps(results))
    """
)


@pytest.mark.slow  # ~100 s: training on three meshes of 8 virtual devices
def test_meshes_match_one_device_and_checkpoints_move_between_meshes(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    reference = results["1"]["losses"]
    assert len(reference) == 4
    # It learns: one fixed batch, dropout off, before and after the 4 steps (4.71 -> 4.46
    # here; the step losses, each on its own batch, move as much from batch to batch).
    before, after = results["1"]["fixed_loss"]
    assert before - after > 0.1, (before, after)
    for name in ("8,1,1", "2,4,1", "2,2,2"):
        assert results[name]["losses"] == pytest.approx(reference, rel=1e-5), name
        assert results[name]["fixed_loss"] == pytest.approx([before, after], rel=1e-5), name
    # The rules really shard: query kernel [D, N, H] over (fsdp, tensor).
    assert results["2,2,2"]["query_spec"] == ["fsdp", "tensor", None]
    assert results["2,4,1"]["query_spec"] == ["fsdp", "tensor", None]
    r = results["2,2,2"]
    assert r["restored_params"] == r["params"]
    assert r["restored_devices"] == [1]
    assert r["next_loss"][0] == pytest.approx(r["next_loss"][1], rel=1e-5)
