"""benchmarks/report.py: the targets' arithmetic, rendered from modeled results."""

from benchmarks import report


def _variant(step, compute, exposed, mfu, terms):
  return {'step_seconds': step, 'compute_seconds': compute, 'mfu': mfu,
          'exposed_communication_seconds': exposed, 'speedup_vs_baseline': 10.0 / step,
          'program_flops_per_chip': 1.25e15, 'compute_terms': terms}


AOT = {'dense_500b': {
    'chips': 1000, 'model_flops_per_step': 1e18, 'remat': 'full', 'modeled': {
        'baseline': _variant(10.0, 7.0, 3.0, 0.5, {'plain: matmul at MXU rate': 6.5,
                                                   'plain: non-matmul': 0.5}),
        'ours': _variant(8.0, 7.6, 0.4, 0.625, {'ring: matmul at MXU rate': 6.4,
                                                'plain: matmul at MXU rate': 0.1,
                                                'ring: matmul HBM-bound excess': 0.1,
                                                'ring: non-matmul': 0.4,
                                                'plain: non-matmul': 0.6})}}}


def test_compute_terms_are_ours_minus_the_baseline():
  lines = report.render_compute_terms(AOT)
  assert '| dense_500b | +0.600 | +0.000 | +0.100 | 0.400 | +0.100 |' in lines


def test_the_mfu_target_names_the_step_it_needs():
  [line, _] = report.render_mfu_target(AOT)
  useful = 0.625 * 8.0  # seconds of the model's FLOPs at peak
  assert 'ours 62.5%, not met' in line
  assert f'a step of {useful / 0.72:.3f} s or less' in line
  assert 'compute alone is 7.600 s (65.8% with no communication exposed)' in line
  assert "matmul FLOPs are 1.25x the model's (with what remat `full` recomputes)" in line
  assert 'its exposed communication (0.400 s)' in line
  assert report.render_mfu_target({}) == []
