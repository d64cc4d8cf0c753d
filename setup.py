"""ringtrain: a Flax training framework for large Transformer and MoE models
whose parallelism layer decomposes collectives together with the einsums that
depend on them, so transfers overlap compute."""

from setuptools import find_packages, setup

# Compatible ranges, so that ringtrain installs into an existing environment.
# The lower bounds are the versions tested (or, for slow-moving libraries, the
# first major version whose API the code uses); constraints.txt pins the exact
# versions `make` installs, for reproducible runs.
setup(
    name='ringtrain',
    version='0.1.0',
    description=__doc__.replace('\n', ' '),
    python_requires='>=3.11',
    packages=find_packages(include=['trainer*', 'models*', 'parallelism*',
                                    'configs*', 'launch*', 'benchmarks*']),
    install_requires=[
        # The JAX stack moves fast: stay within the tested minor versions.
        'jax>=0.10.2,<0.11',
        'jaxlib>=0.10.2,<0.11',
        'flax>=0.12.8,<0.13',
        'optax>=0.2.8,<0.3',
        'orbax-checkpoint>=0.12.8,<0.13',
        'ml-collections>=1.0,<2',
        'ml-dtypes>=0.5',          # bfloat16 safetensors (trainer/convert.py)
        'numpy>=2.0,<3',
        'tensorboardX>=2.6,<3',    # TensorBoard event files without TensorFlow
        'safetensors>=0.4,<1',     # Hugging Face weights, read without pickle
        'tokenizers>=0.19,<1',     # Hugging Face tokenizer.json files (trainer/tokenizer.py)
        'sentencepiece>=0.2,<1',   # SentencePiece .model files (trainer/tokenizer.py)
        'grain>=0.2.18,<0.3',      # the input pipeline's iterator, prefetch and mixing
    ],
    extras_require={
        'plot': ['matplotlib>=3.8,<4'],  # trainer/plot.py, benchmarks/report.py
        'data': ['pyarrow>=15,<27'],     # Parquet input to trainer/prepare.py
        'test': ['pytest>=8,<9.2', 'pytest-xdist>=3.5,<4', 'hypothesis>=6.100,<7'],
        'tpu': ['libtpu==0.0.42.*'],  # ahead-of-time TPU compilation: must match jaxlib 0.10.2
        # NVIDIA GPUs (CUDA 12, with its pip-installed libraries): JAX's own extra, which pins
        # jax-cuda12-plugin to the installed jax's exact version (0.10.2 in constraints.txt).
        'cuda12': ['jax[cuda12]>=0.10.2,<0.11'],
        # trainer/convert.py --check: the reference Llama (CPU torch is enough);
        # transformers >= 4.56 takes from_pretrained(dtype=...).
        'hf': ['torch>=2.4,<3', 'transformers>=4.56,<6'],
    },
)
