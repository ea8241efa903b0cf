# Two commands do all the set-up on a fresh machine:
#   make lab    install everything (once) and open JupyterLab on the course
#   make test   install everything (once) and run every test, notebooks included
# Both are idempotent: the install runs again only when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.course-installed
KERNEL_NAME := distcourse
KERNEL_DISPLAY := Python 3 (distributed training course)

# The torch pin lives in pyproject.toml; read it from there so it is written only once.
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
# Without an NVIDIA GPU, take torch's CPU build: PyPI's default Linux wheel pulls several GB
# of CUDA libraries that a laptop cannot use. Override with `make TORCH_INDEX= ...`.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(HAVE_GPU),,https://download.pytorch.org/whl/cpu)

# nbgrader runs `alembic`, pytest runs `jupyter`: the venv's tools come first, so nothing
# here needs an activated venv.
export PATH := $(abspath $(BIN)):$(PATH)
# Workers started from tests and notebooks share 2 cores on the course machines.
export OMP_NUM_THREADS ?= 1
# Extra options for JupyterLab, e.g. make lab LAB_ARGS="--no-browser --port 8890"
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: install lock lab test test-e2e test-all site lint format bench clean release autograde feedback student \
	roster zip-collect hub leaderboard

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The lock (requirements.lock, written by `make lock`) holds every package but torch, at one
# version each, checked by hash; torch comes from its pin, CPU or CUDA build, with its
# dependencies already in place; then the course itself, which adds no package. `pip check`
# fails if the lock misses something pyproject.toml asks for: run `make lock`.
$(STAMP): pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check --require-hashes --no-deps \
	    -r requirements.lock
	$(BIN)/python -m pip install --disable-pip-version-check \
	    $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1 --timeout 20) \
	    "$(TORCH_PIN)"
	$(BIN)/python -m pip install --disable-pip-version-check --no-deps -e ".[test]"
	$(BIN)/python -m pip check
	$(BIN)/python -m ipykernel install --sys-prefix --name $(KERNEL_NAME) \
	    --display-name "$(KERNEL_DISPLAY)"
	touch $@

# Rewrite requirements.lock from pyproject.toml's pins (needs the network; commit both).
UV_PIN := uv==0.13.8
lock: | $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check "$(UV_PIN)"
	$(BIN)/python tools/lock.py

# nbgrader's exchange (nbgrader_config.py: exchange/ here, or $COURSE_EXCHANGE). Its panels
# (Assignment List, Course List) and the formgrader need it to exist, open to every user
# (mode 0777, as nbgrader itself creates it).
EXCHANGE := $(or $(COURSE_EXCHANGE),$(CURDIR)/exchange)

lab: install
	@test -d "$(EXCHANGE)" || install -d -m 0777 "$(EXCHANGE)"
	$(BIN)/jupyter lab --notebook-dir="$(CURDIR)" --config="$(CURDIR)/jupyter/jupyter_lab_config.py" \
	    $(ROOT_ARGS) $(LAB_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Building the site runs every lecture (once: it is the lectures' test, as nbval was). It runs
# in the background while the other tests do, and tests/test_site.py then checks its pages
# (COURSE_REQUIRE_SITE=1: tests/conftest.py). Whole classes graded end to end (tests marked
# e2e) are left to `make test-all`, which CI runs. The log ends with the 30 slowest tests and
# each lecture's run time: where the time goes.
PYTEST_SELECT ?= -m "not e2e"
test: install lint
	COURSE_REQUIRE_SITE=1 $(BIN)/python -m pytest tests $(PYTEST_SELECT) --durations=30

# The lectures run top to bottom, with their outputs, as HTML pages: build/site/index.html.
site: install
	$(BIN)/python tools/build_site.py --out build/site

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python bench/launch.py
	$(BIN)/python bench/ring.py
	$(BIN)/python bench/network.py
	$(BIN)/python bench/shaped_network.py
	$(BIN)/python bench/autograde.py
	$(BIN)/python bench/autograde_parallel.py

# --- instructors: nbgrader (configured in nbgrader_config.py) ---
ASSIGNMENT_SOURCES = $(sort $(notdir $(wildcard solutions/*)))
SUBMITTED = $(sort $(notdir $(wildcard submitted/*/*)))

# The tests marked e2e: every assignment released and graded through nbgrader as for a class
# (the solution, the blank release, planted bugs, a deadlock, hostile and forged submissions,
# every cheat and alternative of tests/cheats/), then a class graded in parallel and by the
# Slurm recipe. `make test-all` (what CI runs) is `make test` with them: the class is graded
# in a process of its own, after every other test has run (COURSE_CLASS_LAST: on 2 cores,
# beside the other tests, both ran several times slower; tests/conftest.py).
test-e2e: install
	$(BIN)/python -m pytest tests -m e2e
test-all: PYTEST_SELECT =
test-all: export COURSE_CLASS_LAST = 1
test-all: test

# Regenerate the student versions in assignments/ from solutions/ (and register them in the
# gradebook, with schedule.csv's due dates). Reproducible: a second run changes nothing.
release: install
	@for a in $(ASSIGNMENT_SOURCES); do \
	    $(BIN)/nbgrader generate_assignment "$$a" --force || exit 1; done
	@$(BIN)/python -m course_lib.grading.course_admin due-dates

# Grade every notebook in submitted/<student>/<assignment>/ and write grades.csv. Each
# submission runs in a sandbox (bubblewrap); SANDBOX=off grades without one, unprotected.
# JOBS=N grades N submissions at a time, each in a scratch course folder of its own, then
# merges them into gradebook.db and autograded/ (course_lib/grading/batch.py).
# When the grader itself fails on a submission (no sandbox, a judge that cannot start...),
# that submission gets no grade (not a 0), and make stops after grading the others, naming
# each with its cause and writing no grades.csv; `make autograde` again grades them. A
# notebook nbgrader rejects (forged cell metadata, say) scores 0, with a warning.
SANDBOX ?= on
JOBS ?= 1
autograde: release
	@test -n "$(SUBMITTED)" || { echo "Nothing to grade: put submissions in submitted/<student>/<assignment>/"; exit 1; }
	@rm -f not-graded.jsonl
ifeq ($(JOBS),1)
	@failed=""; for a in $(SUBMITTED); do $(BIN)/nbgrader autograde "$$a" --force \
	    $(if $(filter off,$(SANDBOX)),--GradeInSandbox.sandbox=False) || failed="$$failed $$a"; \
	done; test -z "$$failed" || echo "WARNING: nbgrader reported errors in$$failed (its log \
	above names the submissions). A notebook it rejected scores 0; any the grader failed on \
	is listed below."
	@$(BIN)/python -m course_lib.grading.batch not-graded
else
	$(BIN)/python -m course_lib.grading.batch grade --jobs $(JOBS) \
	    $(if $(filter off,$(SANDBOX)),--no-sandbox)
	$(BIN)/python -m course_lib.grading.batch merge
endif
	$(BIN)/nbgrader export --to grades.csv
	@echo "Grades written to grades.csv"
	@$(BIN)/python -m course_lib.grading.report autograded

# The class leaderboard of the open parts, leaderboard/index.html: the submissions whose open
# part passed, ranked by what the grader measured (course_lib/grading/leaderboard.py), each
# under the display name its student chose in the notebook, or an anonymous id.
leaderboard: install
	$(BIN)/python -m course_lib.grading.leaderboard

# The student edition: the folder to give students instead of this repository (no solutions,
# no hidden tests, no tests that hold answers; see tools/student_edition.py).
STUDENT_DIR ?= student-edition
student:
	$(PYTHON) tools/student_edition.py "$(STUDENT_DIR)"

# Import the roster into the gradebook: a CSV with a header row, columns id (required),
# first_name, last_name, email, lms_user_id (the LMS's numeric user id, for zip-collect).
roster: install
	@test -n "$(FILE)" || { echo "usage: make roster FILE=students.csv"; exit 1; }
	$(BIN)/nbgrader db student import "$(FILE)"

# Submissions downloaded from an LMS (Canvas's "Download Submissions" zip) into
# submitted/<student>/<assignment>/, students matched to the roster by lms_user_id.
zip-collect: install
	@test -n "$(FILE)" -a -n "$(ASSIGNMENT)" || { \
	    echo "usage: make zip-collect FILE=submissions.zip ASSIGNMENT=a01_processes"; exit 1; }
	@test -f "$(FILE)" || { echo "No such file: $(FILE)"; exit 1; }
	rm -rf "downloaded/$(ASSIGNMENT)" && mkdir -p "downloaded/$(ASSIGNMENT)/archive"
	cp "$(FILE)" "downloaded/$(ASSIGNMENT)/archive/"
	$(BIN)/nbgrader zip_collect "$(ASSIGNMENT)" --force

# HTML feedback for every autograded submission, in feedback/<student>/<assignment>/.
feedback: install
	@for a in $(SUBMITTED); do $(BIN)/nbgrader generate_feedback "$$a" --force || exit 1; done

# The course on a local JupyterHub, as a class uses nbgrader (jupyter/hub/jupyterhub_config.py):
# students log in, fetch and submit in their own JupyterLab; the instructor grades in the
# course service's formgrader. The hub's proxy, configurable-http-proxy, comes from npm into
# .hub/ (HUB_DIR, which also holds the hub's database, password and the users' homes).
# make hub HUB_PORT=8001 to use another port.
CHP_PIN := configurable-http-proxy@5.3.0
HUB_DIR ?= $(CURDIR)/.hub
HUB_PORT ?= 8000
CHP ?= $(HUB_DIR)/node_modules/.bin/configurable-http-proxy

$(CHP):
	@command -v npm >/dev/null || { echo "make hub needs npm for configurable-http-proxy \
	    (Debian: apt-get install npm)"; exit 1; }
	npm install --prefix "$(HUB_DIR)" --no-audit --no-fund --loglevel=error "$(CHP_PIN)"

hub: install | $(CHP)
	@test -d "$(EXCHANGE)" || install -d -m 0777 "$(EXCHANGE)"
	@mkdir -p "$(HUB_DIR)"
	cd "$(HUB_DIR)" && COURSE_HUB_DIR="$(HUB_DIR)" COURSE_HUB_PROXY="$(CHP)" \
	    COURSE_HUB_PORT="$(HUB_PORT)" COURSE_EXCHANGE="$(EXCHANGE)" \
	    exec "$(abspath $(BIN))/jupyterhub" --config="$(CURDIR)/jupyter/hub/jupyterhub_config.py"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
