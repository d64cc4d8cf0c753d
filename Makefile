# Everything runs in .venv, created on demand; each install is redone when setup.py or
# constraints.txt changes. constraints.txt pins the exact versions (reproducible runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALL := $(PY) -m pip install --quiet -c constraints.txt -e
TRAIN_STAMP := $(VENV)/.installed-train
TEST_STAMP := $(VENV)/.installed-test
# CPU runs: 8 simulated devices, no TPU probing, a persistent compilation cache.
export JAX_PLATFORMS ?= cpu
export RINGTRAIN_COMPILATION_CACHE ?= $(CURDIR)/.cache/jax
export PYTHONUNBUFFERED := 1

.PHONY: train test soak install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Training needs no optional extra: no torch, transformers, libtpu or matplotlib.
$(TRAIN_STAMP): setup.py constraints.txt | $(PY)
	$(INSTALL) .
	touch $@

# The tests exercise every extra: test runner, TPU compiler, Hugging Face check, plots.
$(TEST_STAMP): setup.py constraints.txt | $(PY)
	$(INSTALL) '.[test,tpu,hf,plot,data]'
	touch $@ $(TRAIN_STAMP)

install: $(TRAIN_STAMP)

train: $(TRAIN_STAMP)
	$(PY) -m trainer.train --config configs/default.py --workdir runs/default

# Two pytest workers (pytest-xdist): most tests spend their time tracing and compiling on
# one core. The slowest tests are listed at the end (the suite's budget is 15 minutes).
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

# 500 steps of the default config, synchronizing every step (see trainer/loop.py).
soak: $(TRAIN_STAMP)
	$(PY) -m trainer.train --config configs/default.py --workdir runs/soak \
	  --config.steps=500 --config.eval_every=0 --config.log_every=50

clean:
	rm -rf $(VENV) .cache runs
