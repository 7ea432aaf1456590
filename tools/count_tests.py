"""Counts test cases from the JUnit XML files Bazel leaves in bazel-testlogs.

count_tests.py TESTLOGS [--label L]   prints "passed failed skipped" for that tree
count_tests.py --sum FILE             adds such lines, prints "N passed, M failed"
                                      (", K skipped" when any) and exits 1 on failures
"""
import argparse
import pathlib
import sys
import xml.etree.ElementTree as ET


def count_tree(root: pathlib.Path):
    passed = failed = skipped = 0
    # Only each target's own test.xml: run_K_of_N/ and shard_K_of_N/ directories are
    # left behind by earlier `bazel test --runs_per_test` invocations and are stale.
    xmls = [x for x in root.rglob("test.xml")
            if not any(part.startswith(("run_", "shard_")) for part in x.relative_to(root).parts)]
    for xml in sorted(xmls):
        try:
            tree = ET.parse(xml)
        except ET.ParseError:
            print(f"count_tests: unreadable {xml}", file=sys.stderr)
            failed += 1
            continue
        for case in tree.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None or case.get("status") == "notrun":
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("testlogs", nargs="?")
    ap.add_argument("--label", default="tests")
    ap.add_argument("--sum")
    args = ap.parse_args()
    if args.sum:
        totals = [0, 0, 0]
        for line in pathlib.Path(args.sum).read_text().splitlines():
            for i, n in enumerate(line.split()[:3]):
                totals[i] += int(n)
        passed, failed, skipped = totals
        tail = f", {skipped} skipped" if skipped else ""
        print(f"{passed} passed, {failed} failed{tail}")
        return 1 if failed else 0
    passed, failed, skipped = count_tree(pathlib.Path(args.testlogs).resolve())
    print(f"{args.label}: {passed} passed, {failed} failed, {skipped} skipped", file=sys.stderr)
    print(passed, failed, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
