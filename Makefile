# Set-up and entry points. `make demo` and `make test` create .venv when missing and reuse it afterwards.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.odin-installed
DEMO_ARGS ?=

.PHONY: install demo test bench gpu-check clean-venv system-deps

install: $(STAMP)

# torch first, alone, with pip: on a CPU machine pip takes the local CPU build; everything else is pinned against
# it so that nothing swaps in the multi-GB CUDA stack. The rest (about 240 pinned packages) goes in with uv, which
# keeps the installed torch and installs the same set as pip in a fifth of the time (about 25 s against 100 s on
# 2 cores); pip does it where uv cannot be had or fails (uv reads PyPI, not pip's own index settings). The last
# step lets PyPI's (CUDA) torchvision import beside a CPU torch (see odin_ns/compat/torchvision_hook.py); it does
# nothing where torchvision imports as installed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	{ $(PY) -m pip install --quiet uv -c constraints.txt && \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -e '.[test]' -c constraints.txt; } || \
	  $(PY) -m pip install --quiet -e '.[test]' -c constraints.txt
	$(PY) -m odin_ns.compat.install_pth
	@$(MAKE) --no-print-directory system-deps
	touch $(STAMP)

# open3d (imported by `ns-export`) needs the libusb-1.0 shared library; Debian/Ubuntu images often lack it.
system-deps:
	@$(PY) -c "import ctypes.util, sys; sys.exit(0 if ctypes.util.find_library('usb-1.0') else 1)" || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -q libusb-1.0-0 >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libusb-1.0-0 >/dev/null 2>&1; }; }; } || \
	  echo "note: ns-export needs the libusb-1.0 library (e.g. apt-get install libusb-1.0-0)"

demo: $(STAMP)
	$(VENV)/bin/odin-demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The CUDA path (odin_ns/cli/gpu_check.py): the cuda-marked tests, then a short odin-bench on the GPUs. Without
# CUDA it says so in one line and succeeds.
gpu-check: $(STAMP)
	$(PY) -m odin_ns.cli.gpu_check

bench: $(STAMP)
	$(VENV)/bin/odin-bench

clean-venv:
	rm -rf $(VENV)
