# Everything runs in .venv, created (or refreshed when setup.py changes) on demand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU runs: 8 simulated devices, no TPU probing, a persistent compilation cache.
export JAX_PLATFORMS ?= cpu
export RINGTRAIN_COMPILATION_CACHE ?= $(CURDIR)/.cache/jax
export PYTHONUNBUFFERED := 1

.PHONY: train test soak install clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,tpu]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m trainer.train --config configs/default.py --workdir runs/default

test: $(STAMP)
	$(PY) -m pytest -q tests

# 500 steps of the default config, synchronizing every step (see trainer/loop.py).
soak: $(STAMP)
	$(PY) -m trainer.train --config configs/default.py --workdir runs/soak \
	  --config.steps=500 --config.eval_every=0 --config.log_every=50

clean:
	rm -rf $(VENV) .cache runs
