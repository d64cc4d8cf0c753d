"""The training command: bad input exits 2 with one line; a short run's outputs."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer import train

# A tiny model that trains in seconds; the 3-step run below uses it.
TINY = ['--config.model.d_model=32', '--config.model.num_layers=1',
        '--config.model.num_heads=4', '--config.model.num_kv_heads=4',
        '--config.model.head_dim=8', '--config.model.mlp_dim=64',
        '--config.batch_size=8', '--config.seq_len=32', '--config.eval_steps=2']
DEFAULT = os.path.join(ROOT, 'configs', 'default.py')
TENSOR_4 = ['--config.mesh.data=2', '--config.mesh.tensor=4']  # 8 devices, a ring of 4


@pytest.mark.parametrize('overrides, message', [
    (['--config.model.nope=1'], 'unknown config key: config.model.nope'),
    (['--config.nope.x=1'], 'unknown config key: config.nope'),
    (['--config.steps=ten'], "config.steps='ten' is not a valid int"),
    (['--config.model.scan_layers=maybe'], 'is not a valid bool'),
    (['--config.data.path=/no/such/file.txt'], "data.path='/no/such/file.txt' matches no file"),
    (['--config.data.path=/no/such/tokens.npy'], 'does not exist'),
    (['--config.batch_size=7'], 'batch_size=7 is not divisible by data*fsdp=4'),
    (['--config.mesh.data=3'], 'mesh size product 6'),
    (['--config.mesh.data=-1', '--config.mesh.tensor=-1'], 'at most one mesh size may be -1'),
    (['--config.seq_len=2048'], 'seq_len=2048 exceeds model.max_seq_len=1024'),
    (['--config.hardware.name=tpu_v9'], "hardware.name='tpu_v9'"),
    # a named chip the devices are not (this machine's CPU): trained with mfu 0.00% before
    (['--config.hardware.name=h100'],
     "hardware.name='h100' does not match the devices (8 x 'cpu', which are cpu)"),
    (['--config.model.attention=cudnn'],
     "model.attention='cudnn' runs on an NVIDIA GPU, this run is on the cpu"),
    (['--config.model.attention=flash'], "model.attention='flash' is not one of"),
    (['--config.model.num_kv_heads=3'], 'num_kv_heads=3'),
    (['--config.steps=0'], 'steps=0 must be at least 1'),
    (['--config.model.num_kv_heads=2', *TENSOR_4], 'blocks.0.attn.k_dkh dim 2 over tensor (4)'),
    (['--config.moe.num_experts=4', '--config.moe.top_k=5'], 'moe.top_k=5 must be in'),
    (['--config.moe.num_experts=8', '--config.seq_len=32', *TENSOR_4,
      "--config.mesh.logical_axis_rules=[['batch', 'data'], ['capacity', 'tensor']]"],
     'moe capacity 10 slots (seq_len=32, moe.capacity_factor=1.25) is not divisible by '
     'tensor=4'),
    (['--config.on_nonfinite=ignore'], "on_nonfinite='ignore' is not one of stop, skip"),
    (['--config.optimizer.schedule=step'],
     "optimizer.schedule='step' is not one of cosine, linear, constant, wsd, rsqrt"),
    (['--config.optimizer.decay_fraction=1.5'], 'optimizer.decay_fraction=1.5 is not in [0, 1]'),
    (['--config.optimizer.nu_dtype=fp8'],
     "optimizer.nu_dtype='fp8' is not one of param, float32, bfloat16"),
    (['--config.checkpoint.keep=0'], 'checkpoint.keep=0 must be >= 1'),
    (['--config.parallelism.tune=fast'],
     "parallelism.tune='fast' is not one of 'auto', 'model', 'measure'"),
    (['--config.parallelism.gradient_accumulators=sharded'],  # a plan's choice now
     'unknown config key: config.parallelism.gradient_accumulators'),
    (['--config.parallelism.layer_overrides=unembed=flat'],
     "parallelism.layer_overrides: 'unembed=flat' is not PATTERN=FORM"),
    (['--config.parallelism.layer_overrides=blocks.*.mlp.gate_up=plain'],
     "parallelism.layer_overrides: 'blocks.*.mlp.gate_up' matches no layer"),
    (['--config.checkpoint.on_corrupt=skip'], "on_corrupt='skip'"),
    (['--bogus'], 'unrecognized argument: --bogus'),
    (['--config.hardware.xla_flags=default xla_foo=1'],
     "hardware.xla_flags: 'xla_foo=1' is not a flag of the form --name=value"),
    # values that crashed, or trained nonsense, after writing the workdir
    (['--config.model.num_kv_heads=0'], 'model.num_kv_heads=0 must be at least 1'),
    (['--config.model.d_model=0'], 'model.d_model=0 must be at least 1'),
    (['--config.model.num_layers=0'], 'model.num_layers=0 must be at least 1'),
    (['--config.seed=-1'], 'seed=-1 is not in [0, 2**32)'),
    (['--config.optimizer.learning_rate=inf'], 'learning_rate=inf must be finite and > 0'),
    (['--config.optimizer.learning_rate=0'], 'learning_rate=0.0 must be finite and > 0'),
    ([f'--config.data.path={ROOT}/tests'], f"data.path='{ROOT}/tests' names a directory"),
    # values that ran with a silent surprise: unbounded prefetch, no clipping, NaN updates
    (['--config.data.prefetch=-1'], 'data.prefetch=-1 must be >= 0'),
    (['--config.data.path=a,,b'], "data.path='a,,b' has an empty entry"),
    (['--config.optimizer.grad_clip=-1'], 'optimizer.grad_clip=-1.0 must be finite and >= 0'),
    (['--config.optimizer.b2=1.5'], 'optimizer.b2=1.5 is not in [0, 1)'),
    (['--config.optimizer.eps=0'], 'optimizer.eps=0.0 must be finite and > 0'),
    (['--config.hardware.peak_flops=-1'], 'hardware.peak_flops=-1.0 must be >= 0'),
    (['--config.profile.num_steps=2', '--config.profile.start_step=5'],
     'profile.start_step=5 traces nothing: the run has updates 0 to 0 (steps=1)'),
    (['--config.model.head_dim=33'], 'model.head_dim=33 must be even'),
    (["--config.mesh.logical_axis_rules=[['batch', 'dta']]"],
     "mesh.logical_axis_rules row ['batch', 'dta']: 'dta' is not one of data, fsdp"),
    (["--config.mesh.logical_axis_rules=[['batch', 3]]"],
     "mesh.logical_axis_rules row ['batch', 3]: 3 is not one of data, fsdp"),
    (['--workdir', f'{ROOT}/README.md'], 'README.md exists and is not a directory'),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, overrides, message):
  workdir = tmp_path / 'run'
  code = train.main(['--config', DEFAULT, '--workdir', str(workdir), '--config.steps=1']
                    + overrides)
  err = capsys.readouterr().err.strip()
  assert code == 2
  assert len(err.splitlines()) == 1 and message in err, err
  assert not workdir.exists()


def test_gs_workdir_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code = train.main(['--config', DEFAULT, '--workdir', 'gs://bucket/run', '--config.steps=1'])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert 'gs:// paths are not supported yet' in err and '--workdir /mnt/bucket/run' in err
  assert not os.listdir(tmp_path)


# Takes the workdir lock as a run does, and keeps it until killed.
LOCK_HOLDER = """import sys, time
from trainer import train
lock = train.lock_workdir(sys.argv[1])
print('locked', flush=True)
time.sleep(300)
"""


def test_a_second_run_in_a_workdir_is_refused_naming_the_pid(tmp_path, capsys):
  workdir = tmp_path / 'run'
  holder = subprocess.Popen([sys.executable, '-c', LOCK_HOLDER, str(workdir)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    record = (workdir / train.LOCK_FILE).read_text()
    code = train.main(['--config', DEFAULT, '--workdir', str(workdir), '--config.steps=1'] + TINY)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f'{workdir} is in use by another run (pid {holder.pid} on ' in err
    assert os.listdir(workdir) == [train.LOCK_FILE]  # nothing written
    assert (workdir / train.LOCK_FILE).read_text() == record
  finally:
    holder.kill()
    holder.wait()
  # Killed, it left its lock file behind, but the lock died with it: taken over.
  lock = train.lock_workdir(str(workdir))
  assert json.loads((workdir / train.LOCK_FILE).read_text())['pid'] == os.getpid()
  train.release_workdir(lock)
  assert not os.listdir(workdir)


def test_empty_corpus(tmp_path, capsys):
  (tmp_path / 'empty.txt').write_bytes(b'')
  code = train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'run'),
                     f'--config.data.path={tmp_path / "empty.txt"}'])
  assert code == 2 and 'corpus is empty' in capsys.readouterr().err


@pytest.mark.parametrize('spec, message', [
    (f'{ROOT}/README.md', 'README.md is not a Python module'),
    (f'{DEFAULT}:x', "cannot call get_config('x'): too many positional arguments"),
])
def test_a_config_that_cannot_be_loaded_is_one_line(spec, message, capsys):
  assert train.main(['--config', spec]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_missing_config_file(capsys):
  assert train.main(['--config', '/no/such/config.py']) == 2
  assert 'config file not found: /no/such/config.py' in capsys.readouterr().err


def test_three_step_run_through_the_cli(tmp_path):
  workdir = tmp_path / 'run'
  # No JAX_PLATFORMS: hardware.name=auto finds no TPU or GPU, so 8 simulated CPU devices.
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'} | {'PYTHONPATH': ROOT}
  cmd = [sys.executable, '-m', 'trainer.train', '--config', DEFAULT, '--workdir', str(workdir),
         '--config.steps=3', '--config.log_every=1', '--config.eval_every=2'] + TINY
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train_records = [r for r in records if 'loss' in r]
  eval_records = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in train_records] == [1, 2, 3]
  for r in train_records:
    assert r['loss'] > 0 and r['tokens_per_sec'] > 0 and 0 < r['mfu'] < 1
    assert {'learning_rate', 'grad_norm', 'step_time', 'tflops_per_device'} <= set(r)
  assert [r['step'] for r in eval_records] == [2, 3]
  assert all(0 < r['eval_bpb'] < 10 for r in eval_records)
  _check_timing(records, train_records, eval_records)
  assert 'decisions: unidirectional 8' in proc.stdout and 'costliest (modeled): ' in proc.stdout
  assert 'sharded dims' not in proc.stdout  # the full table is in parallelism_report.json
  assert '% of it in device steps (goodput)' in proc.stdout
  config = json.loads((workdir / 'config.json').read_text())
  assert config['steps'] == 3 and config['model']['d_model'] == 32
  assert config['hardware']['name'] == 'cpu' and 'data=4 x fsdp=1 x tensor=2' in proc.stdout
  assert 'libtpu' not in proc.stderr  # JAX never looked for a TPU
  assert any(name.startswith('events.') for name in os.listdir(workdir / 'tb'))


def _check_timing(records, train_records, eval_records):
  """Every record has wall-clock time and where the time went since the previous one."""
  assert all(r['time'] > 1.6e9 and r['elapsed'] > 0 for r in records)
  assert train_records[0]['compile_s'] > 0 and train_records[0]['setup_s'] > 0
  assert not any('compile_s' in r for r in records[1:])
  assert all(r['device_step_s'] > 0 and 'data_wait_s' in r for r in train_records)
  assert all(r['eval_s'] > 0 for r in eval_records)
  summary = records[-1]  # the run's totals and goodput
  assert summary['step'] == 3 and 0 < summary['goodput'] < 1
  windows = sum(v for r in records for k, v in r.items() if k.endswith('_s')
                and not k.startswith('total_'))
  totals = sum(v for k, v in summary.items() if k.startswith('total_'))
  assert abs(windows - summary['elapsed']) < 0.05 and abs(totals - summary['elapsed']) < 0.05
  assert summary['goodput'] == pytest.approx(summary['total_device_step_s'] / summary['elapsed'],
                                             rel=1e-3)


def test_bad_input_exit_status_from_the_shell(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'trainer.train', '--config', DEFAULT,
                         '--config.steps=x'], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().startswith('error: config.steps=')


def test_a_run_resumes_with_another_way_of_computing_the_step(tmp_path, capsys):
  """Execution-only settings (the attention kernel, remat) may change on resume, as moving
  to another platform or a smaller mesh needs; the model itself may not."""
  argv = ['--config', DEFAULT, '--workdir', str(tmp_path / 'run'), *TINY, '--config.steps=3',
          '--config.eval_every=0', '--config.checkpoint.every=1']
  assert train.main(argv + ['--config.stop_after=2']) == 0
  capsys.readouterr()
  assert train.main(argv + ['--config.model.attention=blockwise',
                            '--config.model.remat=full']) == 0
  assert 'resuming from step 2' in capsys.readouterr().out
