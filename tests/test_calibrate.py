"""benchmarks.calibrate: the modeled row from a compiled program, and bad input."""

import dataclasses
import os

import pytest

from benchmarks import calibrate
from parallelism import step_model
from trainer import config as config_lib, metrics
from tests.conftest import ROOT


def _error_line(capsys) -> str:
  err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith('[')]
  assert len(err) == 1, err
  return err[0]


def _row(measured_mfu: float) -> calibrate.Row:
  """The checked-in v5p program of tests/data, as if it were a calibration row."""
  return calibrate.Row('configs/calibration/maxtext_32b_v5p.py', 'v5p:2x2x2', 8, 10 ** 6,
                       model_flops_per_chip=1e11, measured_mfu=measured_mfu,
                       hlo_path=os.path.join(ROOT, 'tests', 'data',
                                             'async_collective_fusion_v5p.hlo'),
                       coords=None, memory_gib=1.0)


def test_a_row_is_modeled_from_its_program_and_compared_with_the_measurement():
  row = _row(0.5)
  chip = step_model.Chip.from_profile('tpu_v5p')
  m = row.model(chip)
  with open(row.hlo_path, encoding='utf-8') as f:
    program = step_model.analyze(f.read(), chip)
  assert m['step_seconds'] == program.step_seconds > 0
  assert row.program_flops_per_chip == program.flops > 0
  assert m['mfu'] == pytest.approx(1e11 / (chip.peak_flops * program.step_seconds))
  assert m['error_points'] == pytest.approx(100 * m['mfu'] - 50)
  twice = dataclasses.replace(row, model_flops_per_chip=2e11).model(chip)
  assert twice['mfu'] == pytest.approx(2 * m['mfu'])
  assert m['matmul_at_peak_seconds'] <= m['compute_seconds'] <= m['step_seconds']
  assert calibrate.memory_note([row]) == "**Memory.** Every row's program fits a chip."
  big = dataclasses.replace(row, memory_gib=99.4)
  assert calibrate.memory_note([big, row]).startswith(
      "**Memory.** The maxtext_32b_v5p row's program needs 99.4 GiB per chip")
  assert 'above the 95.74 GiB a v5p chip' in calibrate.memory_note([big, row])
  two = calibrate.memory_note([big, dataclasses.replace(big, memory_gib=98.1), row])
  assert two.startswith("**Memory.** The maxtext_32b_v5p and maxtext_32b_v5p rows' programs "
                        'need 99.4 and 98.1 GiB per chip')
  assert two.endswith('The other 1 fit.')
  assert calibrate.memory_note([big, row]).endswith('The other 1 fit.')
  lines = calibrate.table([row])
  assert lines[0].startswith('| config |') and 'maxtext_32b_v5p' in lines[2]


def test_the_default_rows_are_maxtexts_single_slice_runs_by_chip_and_size():
  assert [os.path.basename(c) for c in calibrate.CONFIGS] == [
      'maxtext_22b_v4.py', 'maxtext_52b_v4.py', 'maxtext_16b_v5e.py',
      'maxtext_32b_v5p.py', 'maxtext_64b_v5p.py', 'maxtext_128b_v5p.py',
      'maxtext_256b_v5p.py', 'maxtext_512b_v5p.py']
  # each row left out is a config, with why in docs/calibration.md
  for name in calibrate.NOT_REPRODUCED:
    assert os.path.exists(os.path.join(ROOT, 'configs', 'calibration', f'{name}.py'))
    assert f'`configs/calibration/{name}.py`: ' in calibrate.not_reproduced_note()


def test_each_rows_measurement_is_compared_over_our_flop_count():
  # MaxText's v4 TFLOP/s of 2023 counted 6 x parameters a token and no attention; our MFU
  # counts causal attention too, so the same step time is a higher MFU on our count
  v4 = config_lib.load(os.path.join(ROOT, 'configs/calibration/maxtext_22b_v4.py'), [])
  assert v4.aot.measured_attention == 'none' and v4.aot.measured_mfu == 156 / 275
  m = v4.transformer()
  assert calibrate.on_our_count(v4) == pytest.approx(
      156 / 275 * metrics.flops_per_token(m, 1024) / (6 * metrics.matmul_params(m)))
  assert round(100 * calibrate.on_our_count(v4), 2) == 57.51  # 56.73% on its count
  # the v4 row's ReLU MLP of 24576 as SwiGLU of 16384: the same weights (21.945B, the
  # parameter count configs/calibration/SOURCES.md derives)
  assert round(metrics.matmul_params(m) / 1e9, 2) == 21.94
  assert v4.hardware.xla_flags == '--xla_enable_async_all_gather=true'


def test_a_config_without_a_measurement_is_refused(capsys):
  assert calibrate.main(['--configs', 'configs/default.py']) == 2
  assert 'has no aot.measured_mfu' in _error_line(capsys)


def test_a_bad_override_is_refused_before_anything_compiles(capsys, monkeypatch):
  monkeypatch.setattr(calibrate, 'compile_row', lambda *a: pytest.fail('compiled'))
  assert calibrate.main(['--config.steps=0']) == 2
  assert 'steps=0' in _error_line(capsys)
  assert calibrate.main(['--rows', 'nope']) == 2
  assert 'unrecognized argument: --rows' in _error_line(capsys)


def test_no_configs_and_an_unusable_hlo_dir_are_refused_before_anything_compiles(
    capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(calibrate, 'compile_row', lambda *a: pytest.fail('compiled'))
  for configs in ('', ' , '):
    assert calibrate.main(['--configs', configs]) == 2
    assert f'--configs {configs!r} names no config' in _error_line(capsys)
  (tmp_path / 'file').write_text('')
  assert calibrate.main(['--configs', calibrate.CONFIGS[0], '--hlo_dir',
                         str(tmp_path / 'file')]) == 2
  assert 'is a file, not a directory' in _error_line(capsys)


def test_a_measurement_that_counted_full_attention_is_compared_over_our_count():
  """MaxText's published MFU counted every (query, key) pair of causal attention; over our
  count (each pair once) the same step time is a lower MFU, by our FLOPs over its."""
  path = os.path.join(ROOT, 'configs', 'calibration', 'maxtext_32b_v5p.py')
  cfg = config_lib.load(path, [])
  assert cfg.aot.measured_attention == 'full'
  m = cfg.transformer()
  ours, full = metrics.flops_per_token(m, 2048), metrics.flops_per_token(m, 2048, causal=False)
  assert full - ours == 6 * m.num_layers * 2048 * m.num_heads * m.head_dim
  assert calibrate.on_our_count(cfg) == pytest.approx(0.7147 * ours / full)
  assert round(100 * calibrate.on_our_count(cfg), 2) == 70.29
  causal = config_lib.load(path, ['--config.aot.measured_attention=causal'])
  assert calibrate.on_our_count(causal) == 0.7147
  from trainer import validation  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="aot.measured_attention='half' is not one of"):
    validation.validate(config_lib.load(path, ['--config.aot.measured_attention=half']))


def test_render_takes_no_other_option(capsys):
  assert calibrate.main(['--render', '--fit']) == 2
  assert '--render rewrites the stored rows' in _error_line(capsys)


def test_fit_searches_both_constants_and_each_alone():
  # A row measured as the model times its program with matmuls at 90% of peak: the matmul
  # efficiency alone fits it exactly; the link efficiency alone only as far as slower links
  # lengthen the step by as much, and both together at least as well as either.
  row = _row(0.0)
  sheet = step_model.Chip.from_profile('tpu_v5p', calibrated=False)
  row.measured_mfu = row.model(dataclasses.replace(sheet, matmul_efficiency=0.9))['mfu']
  fitted = calibrate.fit([row])
  alone = fitted['matmul_efficiency alone']
  assert alone['matmul_efficiency'] == pytest.approx(0.9)
  assert alone['worst_error_points'] == pytest.approx(0.0, abs=1e-9)
  links = fitted['link_efficiency alone']
  assert links['link_efficiency'] < 1.0 and 'matmul_efficiency' not in links
  assert links['worst_error_points'] > alone['worst_error_points']
  assert fitted['both']['worst_error_points'] <= alone['worst_error_points'] + 1e-9
  assert calibrate.alternative_note([row]) == ''  # not modeled under ALTERNATIVE
  row.alternative = {'mfu': row.measured_mfu + 0.01, 'error_points': 1.0, 'step_seconds': 1.0}
  assert 'maxtext_32b_v5p +1.0 (worst 1.0 points)' in calibrate.alternative_note([row])


def test_the_fit_is_written_beside_the_constants_set():
  fitted = {'both': {'matmul_efficiency': 0.97, 'link_efficiency': 0.71,
                     'worst_error_points': 4.41},
            'matmul_efficiency alone': {'matmul_efficiency': 0.87, 'worst_error_points': 4.51}}
  chip = step_model.Chip.from_profile('tpu_v5p', calibrated=False)
  note = calibrate.fit_note(fitted, chip, 8.0)
  assert note.startswith('**Fit over these rows**')
  assert 'both: `matmul_efficiency` = 0.97, `link_efficiency` = 0.71 (worst 4.4 points)' in note
  assert 'matmul_efficiency alone: `matmul_efficiency` = 0.87 (worst 4.5 points)' in note
  assert 'The constants set (worst 8.0 points) are none of these' in note
  set_alone = dataclasses.replace(chip, matmul_efficiency=0.87)
  assert ('The constants set are the matmul_efficiency alone fit'
          in calibrate.fit_note(fitted, set_alone, 4.51))
  assert calibrate.fit_note(None, chip, 8.0) == ''


def test_rows_of_one_layer_shape_are_compared_per_layer_and_sequence():
  """256B and 512B share their layers' shape: per layer and sequence a chip runs (64 x 1 and
  128 x 2), the room each measurement leaves beside the program's matmuls."""
  def row(name, step, matmul, measured_mfu):
    return calibrate.Row(f'configs/calibration/maxtext_{name}_v5p.py', 'v5p:8x8x8', 512, 1,
                         model_flops_per_chip=1.0, measured_mfu=measured_mfu, hlo_path='',
                         coords=None, memory_gib=1.0, program_flops_per_chip=1.25,
                         modeled={'step_seconds': step, 'mfu': 0.5,
                                  'matmul_at_peak_seconds': matmul})
  small = row('256b', 10.0, 6.4, 0.5)  # measured 10 s: 156.2 ms, room 56.2 ms a unit
  apart = row('512b', 20.0, 16.0, 0.4)  # measured 25 s over 256 units: room 35.2 ms
  note = calibrate.same_shape_note([small, apart])
  assert note.startswith('**Rows of one layer shape.** maxtext_256b_v5p and maxtext_512b_v5p')
  assert 'MaxText measured 156.2 and 97.7 ms' in note
  assert 'matmuls at the fitted rate take 100.0 and 62.5 ms' in note
  assert 'leaves 56.2 and 35.2 ms' in note and 'charges 56.2 and 15.6 ms' in note
  assert 'no value of it fits these rows together' in note  # rooms 1.6x apart
  assert calibrate.same_shape_note([small, apart], apart=1.7).endswith(
      'The measurements agree on that room.')
  assert calibrate.same_shape_note([small]) == ''


def test_leave_one_out_models_each_row_with_the_constant_fitted_on_the_others():
  # Two rows of one program, measured as the model times it with matmuls at 90% and at 80%
  # of peak: each, held out, is modeled at the other's rate, and misses by the difference.
  sheet = step_model.Chip.from_profile('tpu_v5p', calibrated=False)
  fast, slow = _row(0.0), dataclasses.replace(_row(0.0),
                                              config='configs/calibration/maxtext_64b_v5p.py')
  fast.measured_mfu = fast.model(dataclasses.replace(sheet, matmul_efficiency=0.9))['mfu']
  slow.measured_mfu = slow.model(dataclasses.replace(sheet, matmul_efficiency=0.8))['mfu']
  held_out = calibrate.leave_one_out([fast, slow])
  assert held_out['maxtext_32b_v5p']['fitted'] == {'matmul_efficiency': pytest.approx(0.8)}
  assert held_out['maxtext_64b_v5p']['fitted'] == {'matmul_efficiency': pytest.approx(0.9)}
  gap = 100 * (fast.measured_mfu - slow.measured_mfu)
  assert gap > 0
  assert held_out['maxtext_32b_v5p']['error_points'] == pytest.approx(-gap)
  assert held_out['maxtext_64b_v5p']['error_points'] == pytest.approx(gap)
  note = calibrate.loo_note(held_out)
  assert note.startswith('**Leave-one-out.**') and f'Worst **{gap:.1f} points**' in note


def test_a_row_whose_program_does_not_fit_its_chip_is_refused(capsys, monkeypatch):
  # compiled, but above what a v5p chip gives one program: no chip could have run it
  over = {'memory': {'fits': False, 'total': 97.2 * 2 ** 30}, 'model': {}}
  monkeypatch.setattr(calibrate.aot, 'run_variant', lambda *a: over)
  assert calibrate.main(['--configs', 'configs/calibration/maxtext_64b_v5p.py']) == 1
  line = _error_line(capsys)
  assert 'our program needs 97.2 GiB per chip, above the 95.74 GiB a v5p chip gives one' in line
  assert line.endswith('check it at a batch that fits (--config.batch_size)')


def test_reuse_models_the_kept_program_without_compiling(capsys, monkeypatch, tmp_path):
  program = os.path.join(ROOT, 'tests', 'data', 'async_collective_fusion_v5p.hlo')
  row = 'configs/calibration/maxtext_32b_v5p.py'

  def compiled(ns, *args):  # what launch.aot's worker leaves: the program, memory, coordinates
    os.makedirs(ns.hlo_dir, exist_ok=True)
    with open(program, encoding='utf-8') as f, open(
        os.path.join(ns.hlo_dir, 'maxtext.hlo.txt'), 'w', encoding='utf-8') as out:
      out.write(f.read())
    return {'memory': {'fits': True, 'total': 2 ** 30}, 'model': {}, 'coords': None}

  monkeypatch.setattr(calibrate.aot, 'run_variant', compiled)
  argv = ['--configs', row, '--hlo_dir', str(tmp_path)]
  calibrate.main(argv)
  first = capsys.readouterr().out
  assert (tmp_path / 'maxtext_32b_v5p' / calibrate.ROW_FILE).exists()
  monkeypatch.setattr(calibrate.aot, 'run_variant', lambda *a: pytest.fail('compiled'))
  calibrate.main(argv + ['--reuse'])
  assert capsys.readouterr().out == first  # the same row, modeled from the kept program
  # other inputs than the kept program's: compiled again
  monkeypatch.setattr(calibrate.aot, 'run_variant', compiled)
  calibrate.main(argv + ['--reuse', '--config.batch_size=256'])
  assert capsys.readouterr().out != first
  assert calibrate.main(['--configs', row, '--reuse']) == 2
  assert '--reuse reads the programs a run kept in --hlo_dir' in _error_line(capsys)
