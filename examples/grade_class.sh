#!/bin/bash
# Autograde a class on a Slurm cluster: one array task per student, each grading that
# student's submissions in scratch course folders of their own (grading-scratch/, see
# course_lib/grading/batch.py), then one job, started only once every task succeeded, that
# merges them into gradebook.db and autograded/ and writes grades.csv.
#
# From the course folder (on storage every node sees), after `make release`:
#   bash examples/grade_class.sh submit                  sbatch the array, then the merge
#   SLURM_ARRAY_TASK_ID=3 bash examples/grade_class.sh   one task: the 4th student (sorted)
#   bash examples/grade_class.sh merge                   the merge
#   bash examples/grade_class.sh local                   no Slurm: every task in turn, merge
# Environment: VENV (default .venv), SANDBOX=off to grade without bubblewrap, JOBS (a
# task grades that many of its student's submissions at a time; default: its CPUs).
#SBATCH --job-name=course-grade
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=02:00:00

set -euo pipefail
source "${VENV:-.venv}/bin/activate" # nbgrader, and the alembic it runs, from the course's venv
batch() { python -m course_lib.grading.batch "$@"; }
sandbox=$([ "${SANDBOX:-on}" = off ] && echo --no-sandbox || true)

case "${1:-task}" in
submit)
    n=$(batch students | wc -l)
    [ "$n" -gt 0 ] || { echo "Nothing to grade: submitted/ is empty" >&2; exit 1; }
    array=$(sbatch --parsable --array="0-$((n - 1))" "$0" task)
    sbatch --parsable --dependency="afterok:$array" --job-name=course-merge "$0" merge
    echo "submitted: $n grading tasks (job $array), then the merge"
    ;;
task)
    student=$(batch students | sed -n "$((SLURM_ARRAY_TASK_ID + 1))p")
    [ -n "$student" ] || { echo "no student number $SLURM_ARRAY_TASK_ID" >&2; exit 1; }
    batch grade --student "$student" --jobs "${JOBS:-${SLURM_CPUS_PER_TASK:-1}}" $sandbox
    ;;
merge)
    batch merge
    nbgrader export --to grades.csv
    python -m course_lib.grading.report autograded
    ;;
local)
    n=$(batch students | wc -l)
    for ((i = 0; i < n; i++)); do SLURM_ARRAY_TASK_ID=$i bash "$0" task; done
    bash "$0" merge
    ;;
*)
    echo "usage: bash $0 [submit|task|merge|local]" >&2
    exit 2
    ;;
esac
