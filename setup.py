"""ringtrain: a Flax training framework for large Transformer and MoE models
whose parallelism layer decomposes collectives together with the einsums that
depend on them, so transfers overlap compute."""

from setuptools import find_packages, setup

setup(
    name='ringtrain',
    version='0.1.0',
    description=__doc__.replace('\n', ' '),
    python_requires='>=3.11',
    packages=find_packages(include=['trainer*', 'models*', 'parallelism*',
                                    'configs*', 'launch*', 'benchmarks*']),
    install_requires=[
        'jax==0.10.2',
        'jaxlib==0.10.2',
        'flax==0.12.8',
        'optax==0.2.8',
        'orbax-checkpoint==0.12.8',
        'tensorstore==0.1.86',
        'ml-collections==1.1.0',
        'numpy==2.4.6',
        'tensorboardX==2.6.5',   # TensorBoard event files without TensorFlow
        'protobuf==7.36.2',
        'safetensors==0.8.0',    # Hugging Face weights, read without pickle
        'matplotlib==3.11.2',    # plots of docs/benchmarks.md (benchmarks/report.py)
        'tokenizers==0.23.3',    # Hugging Face tokenizer.json files (trainer/tokenizer.py)
        'sentencepiece==0.2.3',  # SentencePiece .model files (trainer/tokenizer.py)
    ],
    extras_require={
        'test': ['pytest==9.2.0', 'hypothesis==6.170.17',
                 # reference Llama for the Hugging Face import check (CPU torch)
                 'torch==2.13.0', 'transformers==5.24.0'],
        'tpu': ['libtpu==0.0.42.*'],  # ahead-of-time TPU compilation (matches jax 0.10.2)
    },
)
