# kdtree lab. `make lab` runs the notebooks (GPU if present, tiny CPU defaults otherwise); `make test` passes the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first only when the venv has none: 2.13.0 is the CPU build on our machines.
TORCH  ?= torch==2.13.0
EXTRAS ?= lab,test
LAB_ARGS ?=
PYTEST_ARGS ?=
CUDA_ARCH ?= 90a

.PHONY: setup lab lint test test-fast cuda-check clean lib

$(VENV)/.kdtree-setup: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

setup: $(VENV)/.kdtree-setup

lab: setup
	$(PY) -m kdtree lab $(LAB_ARGS)

# ruff (line length 110, [tool.ruff] in pyproject.toml) over the package and the tests.
lint: setup
	$(PY) -m ruff check kdtree tests

# The notebook's checked cells run under nbval; its files go to a scratch folder, never into outputs/.
test: setup
	$(PY) -m ruff check kdtree tests
	KDTREE_OUT_DIR=$$(mktemp -d) $(PY) -m pytest -q --nbval-lax tests notebooks/00_golden_validation.ipynb $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m ruff check kdtree tests
	$(PY) -m pytest -q -m "not slow" tests $(PYTEST_ARGS)

# Every CUDA source must compile for Hopper (also run by tests/test_build.py when nvcc is present).
cuda-check:
	@for f in cuda/*.cu; do [ -e "$$f" ] || continue; echo "nvcc $$f"; \
	  nvcc -std=c++17 -gencode=arch=compute_$(CUDA_ARCH),code=sm_$(CUDA_ARCH) -DKDTREE_WGMMA=1 -c "$$f" -o /dev/null \
	  || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

# libkdtree.so: the C ABI of include/kdtree.h. Each kernel family is built twice by nvcc (sm_90a, and a generic
# target: sm_80 + PTX, sm_90 + PTX for moe_int4) and embedded; the host code is plain C++ (driver API by dlopen).
LIB_DIR ?= build
FATBIN  := $(LIB_DIR)/capi
FAMILIES := tree_build tree_walk verify_attn moe_int4
generic_arch = $(if $(filter moe_int4,$(1)),90,80)
NVCC_LIB = nvcc -std=c++17 -O3 -fatbin -Icuda

lib: $(LIB_DIR)/libkdtree.so

$(FATBIN)/%_sm90a.fatbin: cuda/%.cu cuda/common.cuh | $(FATBIN)
	$(NVCC_LIB) -gencode=arch=compute_90a,code=sm_90a $(if $(filter verify_attn,$*),-DKDTREE_WGMMA=1) $< -o $@

$(FATBIN)/%.fatbin: cuda/%.cu cuda/common.cuh | $(FATBIN)
	$(NVCC_LIB) "-gencode=arch=compute_$(call generic_arch,$*),code=[sm_$(call generic_arch,$*),compute_$(call generic_arch,$*)]" $< -o $@

$(FATBIN)/fatbin_%.h: $(FATBIN)/%.fatbin
	bin2c -c -n fb_$* $< > $@

$(FATBIN):
	mkdir -p $@

$(LIB_DIR)/libkdtree.so: cuda/capi/kdtree_capi.cpp include/kdtree.h $(foreach f,$(FAMILIES),$(FATBIN)/fatbin_$(f).h $(FATBIN)/fatbin_$(f)_sm90a.h)
	g++ -std=c++17 -O2 -fPIC -shared -Wall -Iinclude -I$(FATBIN) $< -o $@ -ldl -lpthread
