from extproc.engine.server import main

main()
