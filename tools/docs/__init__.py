"""The docs generator: every table and page of docs/ that is printed from the code.

- build.py: the generated blocks of docs/FORMAT.md, PARITY.md, PORTING.md, RELIABILITY.md and
  ROSETTA.md, and docs/rosetta.html whole (`python -m tools.docs`; `--check` names what is stale,
  and parity_tests/docs/test_generated.py runs that check);
- idioms.py: the concepts of docs/ROSETTA.md and the excerpts of each, cut from the three
  implementations by qualified name;
- rosetta_page.py: the side-by-side pages built from those excerpts
  (`python -m tools.docs.rosetta_page --screenshot PNG`);
- divergences.py: the divergence catalogue, measured into docs/divergences.json
  (`python -m tools.docs --measure divergences`);
- checkout.py: the checkout these read and write, and the check that it is the one imported.

It reads the checkout's source files and writes its docs/, so it is not part of the installed
package; it imports the package for everything it prints."""
