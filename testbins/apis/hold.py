# Run by the Python interpreter library (patched) through a launcher:
# holds 100,000 strings between "holding" and "released", each step
# waiting for a line on stdin while the test reads the live figures.
import sys


def wait(tag):
    print(tag, flush=True)
    sys.stdin.readline()


wait("start")
keep = ["%07d" % i for i in range(100000)]
wait("holding")
del keep
wait("released")
