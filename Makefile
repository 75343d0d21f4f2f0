# Benchmarks (issue 6). Not tests: they print tables, write benchmarks/out/*.json and log to the MLflow experiment
# `benchmarks` (sqlite:///mlflow.db unless MLFLOW_TRACKING_URI is set). `make bench` runs the core set (~45 min on
# the 2-core machine); results and how to read them: benchmarks/RESULTS.md, whose table of current figures
# `make bench-table` regenerates (benchmarks/figures.yaml, scripts/figures.py). Every script in benchmarks/ has a
# target below, except common.py (the helpers every script imports), gpu_run.sh (the GPU machine's command, rehearsed
# by rehearse-gpu), flower_side.py (the Flower half of bench-flower, run by flower.py in the Flower venv) and
# setup_flower.sh (flower-venv).
PY ?= .venv/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH),)

.PHONY: golden golden-check fault-matrix path-matrix chaos test test-all ci bench bench-overhead bench-hop bench-hop-floor bench-transport bench-threads bench-gas-floor bench-cnn-parts bench-rdt bench-scale bench-flower bench-store bench-batched bench-window \
	bench-placement bench-spill bench-ray-run bench-gpu gpu-bundle rehearse-gpu bench-gpu-server bench-gpu-check bench-cg-crossnode \
	bench-gas-authors bench-snapshot bench-numpy-torch bench-step-cost bench-lm-tokens bench-lm-memory bench-table flower-venv \
	doc-figures check-docs check-docs-full check-results claims check-claims config-doc check-ui

bench: bench-hop bench-transport bench-overhead bench-scale bench-flower bench-store bench-batched bench-window bench-placement \
	bench-spill

# Issue 15: compiled graphs against actor calls and the driver-chained path, side by side.
bench-hop:
	$(PY) benchmarks/hop.py --repeats 5

bench-hop-floor:
	$(PY) benchmarks/hop_floor.py --repeats 7

# Ray 2.60 Compiled Graphs on one node and across two (plain Ray): why CompiledPort compiles same-node actors only.
bench-cg-crossnode:
	$(PY) benchmarks/cg_crossnode.py --all

# Issue 29 item 1: the default transport (auto) against compiled and calls on the quickstart, GAS and ResNet18.
bench-transport:
	$(PY) benchmarks/transport_auto.py --workloads quickstart resnet18 --rounds 4 --repeats 2 --tag transport_auto
	$(PY) benchmarks/transport_auto.py --workloads gas --rounds 3 --repeats 1 --tag transport_auto_gas

# Issue 29 items 2-3: torch threads from the machine against one per actor; GAS against its compute floor and the
# authors' code (GAS_AUTHORS: a checkout of eejiarong/GAS, e.g. from the tool library's fetch; kept outside).
GAS_AUTHORS ?= ../GAS
bench-threads:
	$(PY) benchmarks/transport_auto.py --axis threads --workloads quickstart resnet18 --rounds 4 --repeats 2 --tag threads_auto

bench-gas-floor:
	$(PY) benchmarks/gas_floor.py --authors $(GAS_AUTHORS) --rounds 3

# GAS against the authors' code, covariance full/diagonal/lowrank on the local and Ray backends (~1 h on 2 cores;
# archived figures: benchmarks/archive/RESULTS-2026-11-22-to-25.md). gas_floor.py imports its authors' side.
bench-gas-authors:
	$(PY) benchmarks/gas_vs_authors.py --authors $(GAS_AUTHORS) --rounds 4

# Issue 29 item 4: where cnn_small's rounds go (the steps cost, a spinning neighbour's cost to a computing process);
# item 5: the RDT prototype's round times beside compiled graphs and actor calls.
bench-cnn-parts:
	$(PY) benchmarks/overhead.py --model cnn_small --algorithm sflv2 --clients 4 --steps 20 --rounds 5 --warmup 1 --tag cnn_small_steps20 --no-mlflow
	$(PY) benchmarks/neighbour.py --repeats 5 --steps 100

bench-rdt:
	$(PY) benchmarks/transport_auto.py --axis rdt --workloads quickstart resnet18 --rounds 4 --repeats 2 --tag transport_rdt

bench-overhead:
	$(PY) benchmarks/overhead.py --model cnn_small --algorithm sflv2 sflv1 --clients 4 16 --steps 5 --rounds 5 --warmup 1 --calls --chained --tag cnn_small
	$(PY) benchmarks/overhead.py --model resnet18 --algorithm sflv2 sflv1 --clients 4 16 --steps 1 --batch 8 --rounds 3 --warmup 1 --calls --chained --tag resnet18

# Issue 15: forwards bounded per client actor, placement by load, spilled client state (100,000 clients).
bench-window:
	$(PY) benchmarks/scale2.py window --per-round 10 100 --rounds 3 --warmup 1

bench-placement:
	$(PY) benchmarks/scale2.py placement --rounds 12 --warmup 2

bench-spill:
	$(PY) benchmarks/scale2.py spill --clients 1000 100000 --algorithms psl sflv3 --budget-mb 64 --rounds 3 --warmup 1

# Issue 51: where a small Ray run's time goes (actor starts against rounds), what CI's Ray tests pay for.
bench-ray-run:
	$(PY) benchmarks/ray_run_cost.py

# Clients and server on a GPU against the layouts beside them and a plain PyTorch loop (issues 53, 70; needs a GPU
# and this venv, at most about 9 minutes; each arm's JSON in benchmarks/out/bench-gpu/; `$(PY) benchmarks/bench_gpu.py
# --dry-run` is the same on the CPU at toy size). The GPU machine has no Ray, pydantic nor registry: there, run
# `bash benchmarks/gpu_run.sh OUT` with the bundle that gpu-bundle builds (.gpu-bundle/cp312, carried; ignored here)
# and rehearse-gpu (in CI) runs that same command here in a bare venv, at toy size (benchmarks/RESULTS.md says how).
bench-gpu:
	$(PY) benchmarks/bench_gpu.py --workers 7 --rounds 3

gpu-bundle:
	$(PY) scripts/gpu_bundle.py

rehearse-gpu:
	PY=$(PY) bash scripts/rehearse_gpu.sh

# The GPU server alone, both transports interleaved (issue 15).
bench-gpu-server:
	$(PY) benchmarks/gpu_server.py --workers 7 --rounds 5

# The server host on CUDA against the CPU, same SFLV2 run, local backend (needs a GPU; PASSED when the weights agree
# within 1e-3).
bench-gpu-check:
	$(PY) benchmarks/gpu_check.py

# Batched per-client server copies (algorithm.batched_copies), server side in process and a local-backend round.
bench-batched:
	$(PY) benchmarks/batched_copies.py --model cnn_small resnet18 --clients 10 50 --reps 5 --e2e-reps 3

bench-store:
	$(PY) benchmarks/store.py --rows 12000 --repeats 3

# Issue 25: what runtime.faults.max_retries' round snapshots cost the driver and the round (for a "before", run it
# from an older checkout: benchmarks/RESULTS.md, "Reliability II").
bench-snapshot:
	$(PY) benchmarks/snapshot_cost.py --rounds 12

# numpy arrays against torch tensors through Ray's object store, one driver-chained hop (why raysplit/runtime/
# transport.py sends numpy; archived figures: benchmarks/archive/RESULTS-2026-11-22-to-25.md).
bench-numpy-torch:
	$(PY) benchmarks/transport.py --repeats 15

# Issue 70 item 3: raysplit's cost per step over a plain loop doing the same arithmetic (a model whose own step is a
# fraction of a millisecond): the local backend and Ray, SFLV2, SFLV1, PSL and GAS. Targets: local <= 0.2 ms a step,
# Ray <= 1 ms.
bench-step-cost:
	cd benchmarks && ../$(PY) step_cost.py --methods sflv2 sflv1 psl gas --steps 10 40 --rounds 7 --warmup 2

# Issue 71, Targets: tokens per second training a GPT-2 (6 blocks of width 256, context 128) with LoRA, SFLV1 with one
# client (U-shaped) on the local backend and over Ray, against a plain single-process peft loop on the same batches
# (about 4 minutes on 2 cores). Targets: local within 1.1x of the plain loop, Ray within 1.3x.
bench-lm-tokens:
	$(PY) benchmarks/lm_tokens.py --steps 6 --repeats 7 --warmup 1
# Issue 71 item 3: memory per extra hosted client of a LoRA language model (one frozen base per actor, adapter-only
# states) against the adapters and their optimizer state, and against per-client copies (the behaviour before).
bench-lm-memory:
	$(PY) benchmarks/lm_memory.py --clients 1 2 4 8

# The table of current figures at the top of benchmarks/RESULTS.md: refresh benchmarks/figures.yaml from
# benchmarks/out/*.json where an entry names its JSON, then rewrite the table (make check-results checks it).
bench-table:
	$(PY) scripts/figures.py refresh
	$(PY) scripts/figures.py write

bench-scale:
	$(PY) benchmarks/scale.py --clients 100 1000 10000 --rounds 6

benchmarks/.flower-venv/bin/python:
	bash benchmarks/setup_flower.sh

flower-venv: benchmarks/.flower-venv/bin/python

bench-flower: flower-venv
	$(PY) benchmarks/flower.py --rounds 8 --reps 3

# Tests (README, "Tests"; docs/testing.md): the fast tier, the full tier, and what CI runs (.ci/run: the fast tier, what
# the full tier adds, check-results, check-docs; each phase timed).
test:
	bash scripts/test.sh

test-all:
	bash scripts/test.sh --all

ci:
	bash .ci/run

# Golden fingerprints (tests/golden/): `make golden` reruns every algorithm's tiny run and rewrites its file (a commit
# that changes one says why and reruns that method's result pages); golden-check compares without writing.
golden:
	$(PY) scripts/golden.py

golden-check:
	$(PY) scripts/golden.py --check

# The whole fault matrix (tests/test_fault_matrix.py: every family's case x client or server actor killed mid-round
# x compiled graphs or actor calls; CI runs one case per family). Run it after any change to the restore path.
fault-matrix:
	$(PY) -m pytest -q -p no:cacheprovider --all --matrix --durations=10 tests/test_fault_matrix.py

# Every round-based algorithm's golden run on every Ray path (chained, actor calls, compiled graphs), each bit for bit
# against the local backend (tests/test_direct_steps.py; CI runs one path per algorithm, CI_PATH there). Run it after a
# change to a transport or to how a loop is driven: 72 Ray runs, ~12 min on 2 cores.
path-matrix:
	$(PY) -m pytest -q -p no:cacheprovider --all --matrix --durations=10 tests/test_direct_steps.py -k all_four_paths

# Chaos runs (benchmarks/chaos.py): seeded random kills across the matrix's cases, each run compared with its
# uninterrupted reference; prints a Markdown table and writes benchmarks/out/chaos.json.
chaos:
	$(PY) benchmarks/chaos.py --runs 24 --seed 0

# Documented figures (issues 14, 51): docs/quickstart.md's generated blocks come from running configs/quickstart.yaml,
# whole (60 rounds) and cut to its first 10 rounds. doc-figures rewrites both; check-docs (in CI) reruns the first 10
# rounds and fails naming each figure that differs from their block; check-docs-full does the same for the 60-round
# block (run it after doc-figures; ~5 min on 2 cores). DOC_FIGURES_TIMES: a file to which check-docs appends the
# quickstart's seconds a round (.ci/run's phase file).
# Stamps on result pages (scripts/stamps.py): check-results (in CI, no training) names every stamped page or
# section whose methods' golden fingerprints changed since it was made; stale-on-purpose stamps are printed. It also
# runs check-claims: the claims registry (docs/results/claims.yaml) validates and docs/results/README.md's table,
# verdicts computed by the rule in scripts/claims.py, is what it gives (make claims rewrites the table); and
# benchmarks/RESULTS.md's table of current figures is what benchmarks/figures.yaml gives (make bench-table); and the
# studies' committed run records (docs/results/records/) validate, every records table a page generates being what
# they give (scripts/records.py).
check-results: check-claims
	$(PY) scripts/stamps.py check
	$(PY) scripts/figures.py check
	$(PY) scripts/records.py check

claims:
	$(PY) scripts/claims.py write

check-claims:
	$(PY) scripts/claims.py check

# docs/config.md, the configuration reference, generated from the pydantic models (tests/test_config.py fails when
# it is out of date): rerun after adding or changing a config field or an algorithm parameter.
config-doc:
	$(PY) -m raysplit.cli list config > docs/config.md

doc-figures:
	$(PY) scripts/doc_figures.py

check-docs:
	$(PY) scripts/doc_figures.py --check $(if $(DOC_FIGURES_TIMES),--times $(DOC_FIGURES_TIMES))

check-docs-full:
	$(PY) scripts/doc_figures.py --check --full

# A run opened in MLflow's own UI in headless Chromium (scripts/check_ui.py): the run listed with its dataset, the
# runs page's "Training runs", the metrics tab's count. Installs Debian's chromium only for this target (as root).
check-ui:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium)
	$(PY) scripts/check_ui.py
