from attnviz.cli.main import main

main()
